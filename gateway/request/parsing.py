"""Large request bodies parsed in a separate process, so that no request waits for another's body.

Parsing JSON holds the GIL (orjson releases it nowhere), so a worker thread does not help: while a 4 MB
body is parsed, or its many chat messages rendered and tokenized, the event loop waits, and every other
request of this kvgate process with it (``loadtest/heavy_bodies.py`` measured it: a thread doing the
parse left small requests' p99 at 15-40x idle). Here a body over ``intake.INLINE_PARSE_BYTES`` goes to
a process of its own (one per kvgate process, started at its first large body, niced so the serving
process keeps the CPU first), which decodes and checks it (``body.decode``), computes the prompt's
tokens when kvgate tokenizes (``prompt_tokens.of_route``: tokenizing holds the GIL too), and hands back
the ``bounded`` body: what the request path reads, whatever the body's size. The event loop pays for
sending the bytes and for unpickling a bounded result.

A parsing process that dies (killed, out of memory) fails no request: its pool is replaced and that one
body is parsed in a worker thread, as a last resort; it is logged, and counted in
``kvgate_large_bodies_total{parsed_in="thread"}`` (``"process"``: each large body parsed as it should be).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

from gateway.core.body import Body, bounded, decode
from gateway.kv.prompt_tokens import PromptTokens, Tokens, of_route
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

NICE = 10
"""The parsing process's niceness: on a busy machine the serving process is scheduled first."""

_tokens: PromptTokens | None = None  # the parsing process's tokenizer (its initializer sets it)


def _start(tokens: PromptTokens | None) -> None:
    global _tokens  # the parsing process's own, set once as it starts (never in a serving process)
    _tokens = tokens
    os.nice(NICE)


def parse(raw: bytes, path: str, model_optional: bool, owned: frozenset[str]) -> tuple[Body, Tokens | None]:
    """In the parsing process: the body decoded and checked, bounded, and its prompt's tokens when
    this process has a tokenizer (None otherwise). A ``BadRequest`` travels back as it is raised."""
    body = decode(raw, model_optional=model_optional, owned=owned)
    tokens = of_route(_tokens, path, body.doc) if _tokens is not None else None
    return bounded(body), tokens


class BodyParser:
    """The parsing process of one kvgate process (``close`` stops it)."""

    def __init__(self, tokens: PromptTokens | None, metrics: Metrics | None = None) -> None:
        self.tokens = tokens
        self.metrics = metrics
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def parse(
        self, raw: bytes, path: str, *, model_optional: bool, owned: frozenset[str]
    ) -> tuple[Body, Tokens | None]:
        """``raw`` decoded off the event loop: its bounded body (with ``raw`` back in it) and tokens."""
        loop = asyncio.get_running_loop()
        pool = self._pool()
        try:
            body, tokens = await loop.run_in_executor(pool, parse, raw, path, model_optional, owned)
        except BrokenProcessPool:
            log.warning("the body parsing process died; a new one starts, this body is parsed in a thread")
            if self.pool is pool:
                self.pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            self._count("thread")
            body = await asyncio.to_thread(decode, raw, model_optional=model_optional, owned=owned)
            return body, None
        self._count("process")
        return replace(body, raw=raw), tokens

    def _count(self, parsed_in: str) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.large_bodies, parsed_in).inc()

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self.pool is None:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),  # never a fork of a threaded process
                initializer=_start,
                initargs=(self.tokens,),
            )
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
