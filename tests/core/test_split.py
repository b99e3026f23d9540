"""The pure split of a rollout (core/split.py): the split key of every request shape, under each of the
operator's split keys; the point's properties (stable, monotone in the weight, close to it); and one
tenant with one API key and one system prompt splitting its conversations, turn after turn."""

from __future__ import annotations

import time
from typing import Any

from gateway.core.model import Candidate, VersionState
from gateway.core.split import (
    API_KEY,
    CANDIDATE,
    CONVERSATION,
    CURRENT,
    OPENING_CHARS,
    PROMPT_CHARS,
    USER,
    choose,
    conversation,
    point,
    rollout_view,
    split_key,
)

D1, D2 = "1" * 64, "2" * 64
SYSTEM = "You are the support assistant of a shop that sells bicycles. " * 20  # shared by every conversation


def state(weight: int, split: str = "") -> VersionState:
    cand = Candidate(D2, "t@2", "/s2", "base", "", weight, split)
    return VersionState("t", D1, "t@1", "/s1", "base", 4, candidate=cand)


def chat(*turns: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    """A chat request: the system prompt, then user and assistant turns alternating (user first)."""
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "t", "messages": messages, **extra}


def test_each_split_key_falls_back_to_the_finer_ones() -> None:
    body = chat("hello", user="alice")
    opening = conversation(body)
    assert split_key(body, None) == (USER, "alice"), "the default: the user field first"
    assert split_key(body, "key-1", USER) == (USER, "alice")
    assert split_key(body, "key-1", API_KEY) == (API_KEY, "key-1")
    assert split_key(body, None, API_KEY) == (USER, "alice"), "no API key (keys off): as user"
    assert split_key(body, "key-1", CONVERSATION) == (CONVERSATION, opening), "the user field ignored"
    for user in (None, "", 7, ["alice"]):
        assert split_key(chat("hello", user=user), "key-1") == (CONVERSATION, opening), user
    assert split_key({}, None) == (CONVERSATION, ""), "no prompt at all: one key for all of them"


def test_a_chat_conversation_keeps_its_key_on_later_turns_and_differs_from_the_others() -> None:
    first = conversation(chat("my bike squeaks"))
    assert conversation(chat("my bike squeaks", "oil the chain", "still squeaks")) == first
    assert conversation(chat("my bike squeaks", "oil the chain", "still", "brakes?", "which?")) == first
    assert conversation(chat("my tyre is flat")) != first, "another first message: another conversation"
    assert conversation(chat("my bike squeaks", system="another app")) != first
    # the opening runs to the first user message, whatever comes before it
    developer = {"role": "developer", "content": "be brief"}
    body = {"messages": [developer, *chat("hi")["messages"]]}
    later = {"messages": [*body["messages"], {"role": "assistant", "content": "yes"}]}
    assert conversation(body) == conversation(later) != conversation(chat("hi"))
    # content parts, the Messages API's top-level system, the Responses API's items and instructions
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "u"}}]
    parts = {"messages": [{"role": "user", "content": content}]}
    assert conversation(parts) == conversation({"messages": [*parts["messages"], {"role": "assistant"}]})
    assert "what is this?" in conversation(parts)
    messages_api = {"system": "be kind", "messages": [{"role": "user", "content": "hi"}]}
    assert conversation(messages_api) != conversation({**messages_api, "system": "be terse"})
    items = {"instructions": "help", "input": [{"role": "user", "content": "a"}]}
    turns = [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert conversation({**items, "input": [*items["input"], *turns]}) == conversation(items)
    assert conversation({"input": "a plain input"}) == "a plain input"


def test_a_completion_is_keyed_by_its_prompts_leading_text() -> None:
    transcript = SYSTEM + "\nUser: my bike squeaks, " + "it is an old one. " * 60 + "\nAssistant:"
    assert len(transcript) >= PROMPT_CHARS
    key = conversation({"prompt": transcript})
    assert key == transcript[:PROMPT_CHARS]
    assert conversation({"prompt": transcript + " oil it\nUser: how?\nAssistant:"}) == key, "a later turn"
    other = SYSTEM + "\nUser: my tyre is flat, " + "it is an old one. " * 60 + "\nAssistant:"
    assert conversation({"prompt": other}) != key, "past the shared system prompt"
    tokens = list(range(5000))
    assert conversation({"prompt": tokens}) == conversation({"prompt": [*tokens, 1, 2]}), "token ids"
    assert conversation({"prompt": tokens}).startswith("[0,1,2,")
    assert conversation({"prompt": ["a", "b"]}) == '["a","b"]', "a batch: its canonical rendering"


def test_the_work_is_bounded_by_the_bodys_leading_part() -> None:
    huge = "x" * (4 << 20)
    body = chat(huge + "1")
    many = {"messages": [{"role": "system", "content": huge}] * 100_000 + [{"role": "user", "content": "u"}]}
    started = time.perf_counter()
    keys = [conversation(body), conversation(many), conversation({"prompt": huge}),
            conversation({"prompt": [7] * 1_000_000})]  # fmt: skip
    took = time.perf_counter() - started
    assert all(len(key) <= 20 * (OPENING_CHARS + 8) for key in keys), [len(k) for k in keys]
    assert conversation(body) == conversation(chat(huge + "2")), "only the first OPENING_CHARS count"
    assert took < 0.5, f"{took:.3f} s for four huge bodies"


def test_the_split_is_stable_monotone_and_close_to_the_weight() -> None:
    users = [{"user": f"u{i}"} for i in range(10_000)]
    by_weight = {w: {u["user"] for u in users if choose(state(w), u, None).role == CANDIDATE}
                 for w in (0, 100, 2500, 5000, 10_000)}  # fmt: skip
    assert by_weight[0] == set()
    assert len(by_weight[10_000]) == len(users)
    assert by_weight[100] <= by_weight[2500] <= by_weight[5000], "raising the weight only adds keys"
    assert 2300 <= len(by_weight[2500]) <= 2700
    chosen = choose(state(5000), {"user": "u1"}, None)
    assert chosen == choose(state(5000), {"user": "u1", "prompt": "other"}, "key-id"), "user comes first"
    assert chosen.key_kind == USER
    if chosen.role == CANDIDATE:
        assert (chosen.version.name, chosen.version.epoch) == ("t@2", 5)
    else:
        assert (chosen.role, chosen.version.name) == (CURRENT, "t@1")
    assert point("t", "user", "u1") != point("u", "user", "u1"), "each ID splits its own way"
    assert point("t", "user", "u1") != point("t", "api-key", "u1"), "each kind splits its own way"
    plain = VersionState("t", D1, "t@1", "/s1", "base", 4)
    assert choose(plain, {"user": "u1"}, None).role == CURRENT
    keyed = {choose(state(5000, API_KEY), {"user": f"u{i}"}, "key-1").role for i in range(100)}
    assert len(keyed) == 1, "split by API key: all of a key's traffic on one version"
    assert rollout_view(state(2500, CONVERSATION))["split_key"] == CONVERSATION  # type: ignore[index]
    assert rollout_view(state(2500))["split_key"] == USER, "a rollout stored without one: the default"  # type: ignore[index]


def test_one_tenant_one_key_one_system_prompt_splits_its_conversations_turn_after_turn() -> None:
    """The issue's shape: no user field, one API key, a shared system prompt; 300 conversations at 25%."""
    at_25 = state(2500)
    firsts = {i: choose(at_25, chat(f"question {i}: my order has not arrived"), "key-1") for i in range(300)}
    share = sum(split.role == CANDIDATE for split in firsts.values()) / len(firsts)
    assert 0.15 <= share <= 0.35, f"candidate share {share:.1%}"
    for i, first in firsts.items():
        later = chat(f"question {i}: my order has not arrived", "which order?", "number 12", "found it", "ok")
        assert choose(at_25, later, "key-1") == first, f"conversation {i} changed version on a later turn"
    by_key = {choose(state(2500, API_KEY), chat(f"question {i}"), "key-1").role for i in range(300)}
    assert len(by_key) == 1, "split by API key instead: the whole tenant on one version"
