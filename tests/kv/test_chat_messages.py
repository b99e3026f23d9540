"""A chat request's messages, tools and template arguments as vLLM 0.32 passes them to the template
(content parts flattened or wrapped by the template's content format, tool calls' arguments parsed,
developer messages, tools dumped with their defaults, template arguments filtered by what it reads)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.errors import Unrenderable
from gateway.kv.chat_messages import conversation, template_arguments, tools
from gateway.kv.chat_template import ChatTemplate

STRING = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
OPENAI = ChatTemplate("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}")
PARTS: list[Any] = [
    {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
    "two",
    {"type": "text", "text": ""},
    {"type": "text", "text": None},
    {"type": "refusal", "refusal": "three"},
]


def test_parts_are_joined_for_a_string_template_and_wrapped_for_an_openai_one() -> None:
    message = {"role": "user", "content": PARTS, "name": "ann", "extra": "dropped"}
    assert conversation([message], STRING) == [{"role": "user", "content": "one\ntwo\nthree", "name": "ann"}]
    assert conversation([message], OPENAI) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "two"},
                {"type": "text", "text": ""},
                {"type": "text", "text": "three"},
            ],
            "name": "ann",
        }
    ]
    assert conversation([{"role": "user", "content": "s"}], OPENAI)[0]["content"] == [
        {"type": "text", "text": "s"}
    ]


def test_tool_calls_arguments_are_parsed_and_tool_results_are_one_string() -> None:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"z": 1, "a": [2]}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
    ]
    messages = [
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "why"},
        {
            "role": "tool",
            "tool_call_id": "a",
            "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
        },
        {
            "role": "assistant",
            "content": "done",
        },
    ]
    for template in (STRING, OPENAI):
        assistant, tool, last = conversation(messages, template)
        assert assistant["tool_calls"] == [
            {"id": "a", "function": {"arguments": {"z": 1, "a": [2]}, "name": "f"}, "type": "function"},
            {"id": "b", "function": {"arguments": {}, "name": "g"}, "type": "function"},
            {"id": "c", "function": {"arguments": {}, "name": "h"}, "type": "function"},
        ]
        assert assistant["reasoning"] == assistant["reasoning_content"] == "why"
        assert tool == {"role": "tool", "content": "x\ny", "tool_call_id": "a"}
        assert last == {
            "role": "assistant",
            "content": "done" if template is STRING else [{"type": "text", "text": "done"}],
        }, "an empty tool_calls list is dropped"


def test_developer_messages_become_system_when_the_template_never_names_the_role() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "d"},
    ]
    assert conversation(messages, STRING) == [
        {"role": "system", "content": "s\n\nd"},
        {"role": "user", "content": "u"},
    ]
    named = ChatTemplate("{% if messages[0].role == 'developer' %}{% endif %}")
    assert conversation(messages, named)[2] == {"role": "developer", "content": "d", "tools": None}


def test_a_billing_header_line_is_dropped_from_system_messages() -> None:
    message = {"role": "system", "content": "x-anthropic-billing-header: cch=1\nthe prompt"}
    assert conversation([message], STRING) == [{"role": "system", "content": "the prompt"}]


def test_tools_are_dumped_as_the_request_model_dumps_them() -> None:
    given = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x": 1}, "y": 2},
        {"function": {"name": "g", "strict": True}, "defer_loading": True},
    ]
    assert tools({"tools": given}) == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
        },
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": None,
                "parameters": None,
                "strict": True,
                "defer_loading": True,
            },
            "defer_loading": True,
        },
    ]
    assert tools({}) is None


def test_template_arguments_are_those_the_template_reads() -> None:
    template = ChatTemplate("{{ persona }}{{ enable_thinking }}{{ reasoning_effort }}")
    body = {"chat_template_kwargs": {"persona": "p", "unread": 1, "skipped": None}, "reasoning_effort": "low"}
    assert template_arguments(body, template) == {
        "persona": "p",
        "reasoning_effort": "low",
        "enable_thinking": True,
        "documents": None,
    }
    with pytest.raises(Unrenderable, match="chat-template-kwargs"):
        template_arguments({"chat_template_kwargs": {"chat_template": "x"}}, template)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
        {"role": "user", "content": [{"type": "text", "text": "x", "uuid": "u"}]},
        {"role": "user", "content": 5},
        {"content": "no role"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
        {"role": "developer", "content": "d", "tools": [{"type": "function", "function": {"name": "f"}}]},
    ],
)
def test_what_kvgate_does_not_reproduce_is_unrenderable(message: dict[str, Any]) -> None:
    with pytest.raises(Unrenderable):
        conversation([message], STRING)
