"""Each base model's tokenizer, found by kvgate itself: what precise routing needs, per base, with no flag.

A prompt is keyed by its tokens as the replica computes them, so every base a replica serves needs its
own tokenizer (two bases in one pool: two tokenizers; one base's tokens never key another's requests).
Where each comes from, first found wins:

1. the ``tokenizer`` setting: ``base_model``'s, read at start; one that cannot be read stops kvgate
   (an explicit setting that cannot be honoured fails closed);
2. the base's directory in ``base_model_dirs`` (``NAME=PATH``, the one kvgate reads for fingerprints);
3. the root a replica lists for its base (``/v1/models``: vLLM's ``--model`` path) when it is a
   directory kvgate can read (the same volume mounted at the same path, as deploy/ does).

A base for which none gives a readable ``tokenizer.json`` has no tokenizer: its requests are routed on
the predicted index, and every replica serving it shows it (``problem``: "no tokenizer for base X: why")
as its routing trust on ``/healthz`` and in ``kvgate_routing_trust``. An automatic source that fails is
never an error: it is tried again when what the replicas list changes (a new root), and the base keeps
the predicted index meanwhile. Reading a tokenizer (a ``tokenizer.json`` of megabytes, its templates
compiled) runs in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from gateway.core.identity import base_name
from gateway.fleet.base_prints import base_directory
from gateway.fleet.replicas import Replica
from gateway.kv.prompt_tokens import PromptTokens

log = logging.getLogger(__name__)

SETTING = "the tokenizer setting"


class Tokenizers:
    """Base name -> its tokenizer (``for_base``), or why there is none (``problem``)."""

    def __init__(self, found: dict[str, PromptTokens], model_dirs: dict[str, Path]) -> None:
        self.found = dict(found)
        self.model_dirs = dict(model_dirs)
        self.origin = dict.fromkeys(found, SETTING)
        """Base name -> where its tokenizer was read (``SETTING``, or a directory)."""
        self.missing: dict[str, str] = {}
        """Base name -> why it has no tokenizer (what was tried)."""
        self._tried: dict[str, Path | None] = {}  # base name -> the directory last tried (None: none)

    @classmethod
    def at_start(cls, base_model: str, explicit: Path | None, model_dirs: dict[str, Path]) -> Tokenizers:
        """With ``explicit`` (the ``tokenizer`` setting) read now as ``base_model``'s: ``OSError`` /
        ``ValueError`` / the tokenizer library's error when it cannot be, which stops the start."""
        found = {base_model: _read(explicit)} if explicit is not None else {}
        return cls(found, model_dirs)

    def for_base(self, base: str) -> PromptTokens | None:
        """The tokenizer of ``base`` (a served name, or a base identity ``name=root``), if found."""
        return self.found.get(base_name(base))

    def problem(self, base: str | None) -> str | None:
        """Why requests for ``base`` cannot be keyed by their tokens (None: they can, or no base yet)."""
        if base is None:
            return None
        name = base_name(base)
        if name in self.found:
            return None
        return f"no tokenizer for base {name}: {self.missing.get(name, 'not looked for yet')}"

    async def learn(self, replicas: Iterable[Replica]) -> None:
        """Look for the tokenizer of every base the replicas list that has none yet, where it was not
        already looked for in the same place; each read in a thread."""
        for replica in replicas:
            name = replica.listing.base_name
            if name is None or name in self.found:
                continue
            directory = base_directory(self.model_dirs, replica.listing)
            if name in self._tried and self._tried[name] == directory:
                continue
            self._tried[name] = directory
            if directory is None:
                self.missing[name] = (
                    "kvgate cannot read its files (no base_model_dirs entry, and its replicas list no root)"
                )
                log.warning("%s: routed on the predicted index", self.problem(name))
                continue
            try:
                tokens = await asyncio.to_thread(_read, directory)
            except Exception as exc:  # whatever the files hold: this source fails, kvgate carries on
                why = f"{directory} has no readable tokenizer ({type(exc).__name__}: {exc})"
                self.missing[name] = why[:300]
                log.warning("%s: routed on the predicted index", self.problem(name))
                continue
            self.found[name], self.origin[name] = tokens, str(directory)
            self.missing.pop(name, None)
            log.info(
                "tokenizer of base %s read from %s: its prompts are keyed by their tokens", name, directory
            )

    def health(self) -> dict[str, str]:
        """For ``/healthz`` (detail): per base, where its tokenizer was read, or why there is none."""
        return {
            **{name: f"from {origin}" for name, origin in self.origin.items()},
            **{name: f"none: {why}" for name, why in self.missing.items()},
        }


def _read(path: Path) -> PromptTokens:
    """A tokenizer, said at once when kvgate cannot render its model's chat prompts as vLLM does."""
    tokens = PromptTokens.from_path(path)
    if tokens.chat_problem is not None:
        log.warning(
            "chat prompts are routed on the predicted index: kvgate cannot render %s's chat template as "
            "vLLM does (%s); completions are keyed by their tokens",
            path,
            tokens.chat_problem,
        )
    return tokens
