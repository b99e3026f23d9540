"""A chat template compiled as transformers compiles it, and what vLLM reads from it.

transformers 5 (``transformers/utils/chat_template_utils.py``, ``_cached_compile_jinja_template``): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``{% generation %}``
tag (its ``AssistantTracker``: the block renders its body; the character spans it records only serve
``return_assistant_tokens_mask``, never the text), ``loopcontrols``, its own ``tojson`` (``json.dumps``:
no HTML escaping, non-ASCII kept, ``indent``/``separators``/``sort_keys``), ``raise_exception`` and
``strftime_now`` (the local time of the process that renders: kvgate's clock and time zone stand for
the replica's).

vLLM 0.32 (``vllm/renderers/hf.py``): the variables a template reads (``jinja2.meta``) decide which
``chat_template_kwargs`` reach it; the content format (``_detect_content_format``: ``openai`` when the
template loops over a message's ``content``, else ``string``) decides how content parts are passed;
``_detect_developer_role_support`` whether a ``developer`` message stays one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Literal

import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers' AssistantTracker)."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
        return block.set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        text: str = caller()
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One template's source, compiled, with what vLLM reads from it. Raises ``jinja2.TemplateError``
    when it does not compile (transformers cannot compile it either)."""

    def __init__(self, source: str) -> None:
        env = environment()
        self.source = source
        self.template = env.from_string(source)
        ast = env.parse(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_format = _content_format(ast)
        self.developer = '"developer"' in source or "'developer'" in source

    def render(self, limit: int | None = None, /, **variables: Any) -> str:
        """The template rendered; with ``limit``, only until more than ``limit`` characters are out
        (jinja renders in order: that text is the start of the whole one, whatever follows)."""
        if limit is None:
            return self.template.render(**variables)
        pieces, size = [], 0
        for piece in self.template.generate(**variables):
            pieces.append(piece)
            size += len(piece)
            if size > limit:
                break
        return "".join(pieces)

    def __reduce__(self) -> tuple[type[ChatTemplate], tuple[str]]:
        """Compiled anew where it is unpickled (the body lane: ``request.body_lane``)."""
        return ChatTemplate, (self.source,)


# --- vLLM's content format detection (vllm/renderers/hf.py, _iter_nodes_assign_content_item) ----------


def _content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    try:
        next(_content_loops(ast))
    except StopIteration:
        return "string"
    except ValueError:  # vLLM's detection fails (an assertion) and falls back to its default
        return "string"
    return "openai"


def _target(loop: jinja2.nodes.For) -> str:
    if not isinstance(loop.target, jinja2.nodes.Name):
        raise ValueError("a loop target that is not a name")
    return loop.target.name


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return _is_var(node.node, name) and isinstance(arg, jinja2.nodes.Const) and arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _assigned_from(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    yield name
    related = [name]
    while related:
        current = related.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                if not isinstance(assign.target, jinja2.nodes.Name):
                    raise ValueError("an assignment target that is not a name")
                yield assign.target.name
                if assign.target.name != current:
                    related.append(assign.target.name)


def _message_names(root: jinja2.nodes.Node) -> Iterator[str]:
    names = list(_assigned_from(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, name) for name in names):
            yield _target(loop)


def _content_loops(root: jinja2.nodes.Node) -> Iterator[str]:
    """The loops over a message's content: directly, through a macro parameter given
    ``message.content``, or over a variable named ``content`` outside macros."""
    messages = list(_message_names(root))
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content") for m in messages):
                    params.add(macro.args[i].name)
            for keyword in call.kwargs:
                if keyword.key in names and any(
                    _is_var_or_elems(keyword.value, m, "content") for m in messages
                ):
                    params.add(keyword.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, m, "content") for m in messages):
            yield _target(loop)
            continue
        if not isinstance(loop.iter, jinja2.nodes.Name):
            continue
        given = loop.iter.name in params_by_loop.get(id(loop), ())  # a macro parameter given message.content
        if given or (id(loop) not in in_macros and loop.iter.name == "content"):
            yield _target(loop)
