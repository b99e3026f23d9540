"""What Redis answers, as Python: a reply is bytes or str (a client made with or without
``decode_responses``), and the table's code reads both the same way."""

from __future__ import annotations


def as_text(value: bytes | str, errors: str = "strict") -> str:
    """A reply's text (``errors`` as ``bytes.decode``'s: "replace" where a reply is only shown)."""
    return value.decode(errors=errors) if isinstance(value, bytes) else value
