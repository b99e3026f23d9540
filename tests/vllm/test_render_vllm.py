"""kvgate's tokens equal the real replica's ``/tokenize`` for chat templates written for the fixture
(``tests/support/fixtures/chat_templates/``), each using one feature of transformers' rendering or vLLM's
message handling: ``strftime_now``, ``tojson`` over HTML characters and non-ASCII, content parts (an
``openai`` content-format template), ``{% generation %}``, tools with tool calls and results, and a
multi-turn template with ``add_generation_prompt``, ``continue_final_message`` and a template argument.

vLLM renders each template sent with the request (the session replicas trust request templates);
kvgate reads it from a tokenizer directory of its own: the fixture's tokenizer files with that
``chat_template.jinja``. A kvgate started with the ``{% generation %}`` template serves and keys chat.
"""

from __future__ import annotations

import shutil
from array import array
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.dev.vllm_process import VllmProcess
from gateway.kv.prompt_tokens import PromptTokens, Unrendered
from tests.vllm.conftest import GatewayFactory

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]
TEMPLATES = Path(__file__).parents[1] / "support" / "fixtures" / "chat_templates"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HTML = 'Is 3 < 4 && 5 > 2? Say "yes" </script><b>bold</b> café ünïcode ✓ 東京 emoji 🙂'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather <today> in a city & its region",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Zürich, 東京"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "no_arguments"}},
]
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Zürich <and> Tokyo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "not json"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 °C & <sunny>"},
    {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": [{"type": "text", "text": "8 °C"}, {"type": "text", "text": "rain"}],
    },
]
TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": HTML},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "And again,\n\twith  spaces?  "},
]
PARTS: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "System in parts."}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "first part"},
            {"type": "text", "text": "second <part>", "cache_control": {"type": "ephemeral"}},
            "a bare string part",
            {"type": "text", "text": ""},
        ],
    },
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "I would rather not."}]},
    {"role": "user", "content": "plain string content"},
]

CASES: dict[str, list[dict[str, Any]]] = {
    "dated": [
        {"messages": TURNS},
        {"messages": TURNS[1:], "add_generation_prompt": False},
        {
            "messages": [*TURNS, {"role": "developer", "content": "A later rule."}]
        },  # merged into the system one
    ],
    "tojson": [{"messages": TURNS}, {"messages": [{"role": "user", "content": HTML, "name": "ünï"}]}],
    "parts": [{"messages": PARTS}, {"messages": PARTS[1:2], "add_generation_prompt": False}],
    "generation": [{"messages": TURNS}, {"messages": TURNS[:3], "add_generation_prompt": False}],
    "tools": [{"messages": TOOL_TURNS, "tools": TOOLS}, {"messages": TOOL_TURNS[:1]}, {"messages": PARTS}],
    "turns": [
        {"messages": TURNS},
        {"messages": TURNS[1:]},
        {"messages": TURNS[:3], "add_generation_prompt": False, "continue_final_message": True},
        {"messages": TURNS, "chat_template_kwargs": {"persona": "You are terse & <strict>.", "unused": 1}},
        {"messages": PARTS},
        {"messages": [{"role": "developer", "content": "Be brief."}, *TURNS[1:]]},
    ],
}


def tokenizer_dir(fixture_dir: Path, template: str, into: Path) -> Path:
    into.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(fixture_dir / "model" / name, into / name)
    shutil.copy(TEMPLATES / f"{template}.jinja", into / "chat_template.jinja")
    return into


async def vllm_tokens(http: aiohttp.ClientSession, replica: VllmProcess, body: dict[str, Any]) -> list[int]:
    async with http.post(f"{replica.url}/tokenize", json={"model": "base", **body}) as response:
        assert response.status == 200, await response.text()
        tokens: list[int] = (await response.json())["tokens"]
        return tokens


async def test_every_feature_has_a_template() -> None:
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(CASES)


@pytest.mark.parametrize("template", sorted(CASES))
async def test_kvgate_tokens_equal_the_replicas_tokenize(
    template: str,
    vllm_replicas: list[VllmProcess],
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    tmp_path: Path,
) -> None:
    tokens = PromptTokens.from_path(tokenizer_dir(fixture_dir, template, tmp_path / template))
    source = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    text = "A completion prompt: " + HTML
    assert tokens.completion({"prompt": text}) == array(
        "q", await vllm_tokens(http, vllm_replicas[0], {"prompt": text})
    )
    for body in CASES[template]:
        ours = tokens.chat(body)
        assert not isinstance(ours, Unrendered), (template, body, ours)
        theirs = await vllm_tokens(http, vllm_replicas[0], {**body, "chat_template": source})
        assert ours == array("q", theirs), (template, body)


@pytest.mark.parametrize("template", sorted(CASES))
async def test_a_chat_completion_counts_the_tokens_kvgate_computed(
    template: str,
    vllm_replicas: list[VllmProcess],
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    tmp_path: Path,
) -> None:
    """The chat route itself (not only /tokenize): its ``usage.prompt_tokens`` is kvgate's count."""
    tokens = PromptTokens.from_path(tokenizer_dir(fixture_dir, template, tmp_path / template))
    body = CASES[template][0]
    ours = tokens.chat(body)
    assert not isinstance(ours, Unrendered)
    source = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    request = {"model": "base", **body, "chat_template": source, "max_tokens": 1, "temperature": 0}
    if "tools" in body:
        request["tool_choice"] = "none"  # the replicas run no tool parser
    async with http.post(f"{vllm_replicas[1].url}/v1/chat/completions", json=request) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["usage"]["prompt_tokens"] == len(ours)


async def test_a_kvgate_with_a_generation_template_starts_and_keys_chat(
    make_gateway: GatewayFactory, http: aiohttp.ClientSession, fixture_dir: Path, tmp_path: Path
) -> None:
    directory = tokenizer_dir(fixture_dir, "generation", tmp_path / "generation")
    async with make_gateway(kv_events=True, tokenizer=directory) as gateway:
        body = {"model": "base", "messages": TURNS, "max_tokens": 1}
        async with http.post(f"{gateway.url}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
        registry = gateway.metrics.registry
        unrendered = [
            s for m in registry.collect() if m.name == "kvgate_prompt_unrendered" for s in m.samples
        ]
        assert not [s for s in unrendered if s.name.endswith("_total") and s.value], "every chat was rendered"
    assert not isinstance(PromptTokens.from_path(directory).chat(body), Unrendered)
