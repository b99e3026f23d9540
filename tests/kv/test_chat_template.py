"""A chat template compiled as transformers compiles it (tojson, strftime_now, {% generation %},
raise_exception, loop controls) and what vLLM reads from it (variables, content format, developer role).
The real server's rendering of each is compared in tests/vllm/test_render_vllm.py."""

from __future__ import annotations

from datetime import datetime

import jinja2
import pytest

from gateway.kv.chat_template import ChatTemplate


def test_tojson_is_transformers_own_no_html_escaping_and_non_ascii_kept() -> None:
    template = ChatTemplate("{{ value | tojson }}|{{ value | tojson(indent=2, sort_keys=true) }}")
    value = {"z": "<b>&'café 東京'</b>", "a": 1}
    assert template.render(value=value) == (
        '{"z": "<b>&\'café 東京\'</b>", "a": 1}|{\n  "a": 1,\n  "z": "<b>&\'café 東京\'</b>"\n}'
    )


def test_strftime_now_is_today_and_generation_renders_its_body() -> None:
    template = ChatTemplate('{{ strftime_now("%Y-%m-%d") }} {% generation %}said{% endgeneration %}')
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = template.render()
    assert rendered in (f"{before} said", f"{datetime.now().strftime('%Y-%m-%d')} said")  # across midnight


def test_raise_exception_loop_controls_and_trimmed_blocks() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m == 'skip' %}{% continue %}{% endif %}\n  {{ m }}\n{% endfor %}"
        "{% if fail %}{{ raise_exception('refused') }}{% endif %}"
    )
    assert template.render(messages=["a", "skip", "b"]) == "  a\n  b\n"
    with pytest.raises(jinja2.TemplateError, match="refused"):
        template.render(messages=[], fail=True)


def test_a_template_that_cannot_compile_raises_a_template_error() -> None:
    with pytest.raises(jinja2.TemplateError):
        ChatTemplate("{% generation %}never closed")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for message in messages %}{{ message['content'] }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set ms = messages %}{% for m in ms %}{% for p in m.content | list %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set content = m.content %}"
            "{% for p in content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
            "openai",
        ),
        ("{% for a, b in messages %}{% endfor %}", "string"),  # vLLM's detection gives up: its default
    ],
)
def test_the_content_format_is_detected_as_vllm_detects_it(source: str, expected: str) -> None:
    assert ChatTemplate(source).content_format == expected


def test_variables_and_developer_role() -> None:
    template = ChatTemplate("{% if m == 'developer' %}{{ persona }}{% endif %}{{ messages }}")
    assert template.variables == {"m", "persona", "messages"}
    assert template.developer
    assert not ChatTemplate("{{ messages }}").developer
