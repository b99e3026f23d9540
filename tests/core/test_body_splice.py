"""``core.body.forwarded``: the client's bytes spliced in place where that is exact, serialized otherwise;
either way the replica reads the same members (the client's, less what the gateway owns, plus its own)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway.core.body import decode, forwarded

OWNED = {"model": "t@0123456789abcdef", "cache_salt": "kvg-" + "a" * 32}


def expected(doc: dict[str, Any], owned: dict[str, str]) -> dict[str, Any]:
    kept = {k: v for k, v in doc.items() if k not in ("model", "cache_salt", "extra_key")}
    return {**kept, **owned}


SPLICED_IN_PLACE = {
    "compact": b'{"model":"t","prompt":"hi","max_tokens":3}',
    "spaced": b'{ "model" : "t" , "prompt": "hi" }\n',
    "model last": b'{"prompt": "hi", "model": "t"}',
    "json.dumps": json.dumps({"model": "t", "prompt": 'é😀 "q" \\ /', "n": [1, {"a": None}]}).encode(),
    "non-ascii as is": '{"model":"t","prompt":"é😀"}'.encode(),
    "model only": b'{"model":"t"}',
}
SERIALIZED = {
    "a nested model key": b'{"model":"t","metadata":{"model":"x"}}',
    "model as a value": b'{"model":"t","messages":[{"role":"model"}]}',
    "quoted model in text": b'{"model":"t","prompt":"say \\"model\\" twice"}',
    "escaped key": b'{"mod\\u0065l":"t","x":{"model":"t"}}',
    "duplicate model": b'{"model":"x","model":"t"}',
    "client salt": b'{"model":"t","cache_salt":"mine","prompt":"p"}',
    "escaped value": b'{"model":"\\u0074","prompt":"p"}',
}


@pytest.mark.parametrize("name", sorted(SPLICED_IN_PLACE))
def test_the_client_bytes_are_spliced_in_place(name: str) -> None:
    raw = SPLICED_IN_PLACE[name]
    body = decode(raw)
    out = forwarded(body, OWNED)
    assert orjson.loads(out) == expected(orjson.loads(raw), OWNED)
    untouched = raw.split(b'"t"', 1)[1].rstrip().removesuffix(b"}")
    assert untouched in out  # the rest of the client's bytes, as sent: not serialized again


@pytest.mark.parametrize("name", sorted(SERIALIZED))
def test_bodies_a_byte_splice_could_get_wrong_are_serialized(name: str) -> None:
    raw = SERIALIZED[name]
    body = decode(raw)
    out = forwarded(body, OWNED)
    assert orjson.loads(out) == expected(orjson.loads(raw), OWNED)
    assert out.count(b'"t@0123456789abcdef"') == 1


def test_without_a_model_to_write_the_clients_model_is_dropped_as_before() -> None:
    body = decode(b'{"model":null,"prompt":"p"}', model_optional=True)
    assert orjson.loads(forwarded(body, {"cache_salt": "kvg-1"})) == {"prompt": "p", "cache_salt": "kvg-1"}


def test_a_route_owned_member_sent_by_the_client_is_replaced() -> None:
    raw = b'{"model":"t","request_id":"mine","input":"x"}'
    body = decode(raw, owned=frozenset({"request_id"}))
    out = orjson.loads(forwarded(body, {"model": "t@1", "request_id": "resp_kvg"}))
    assert out == {"input": "x", "model": "t@1", "request_id": "resp_kvg"}
