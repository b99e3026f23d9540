"""Graceful shutdown: once draining, new requests are refused and ``/healthz`` says so, while the
requests already running finish (up to ``shutdown_timeout``)."""

from __future__ import annotations

import asyncio
import logging

from gateway.core.errors import ShuttingDown

log = logging.getLogger(__name__)


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        """Count one request while it runs (``end`` once it has); refused once draining."""
        if self.draining:
            raise ShuttingDown("kvgate is shutting down: send the request to another kvgate")
        self.active += 1
        self._idle.clear()

    def end(self) -> None:
        self.active -= 1
        if not self.active:
            self._idle.set()

    async def drain(self, within: float) -> bool:
        """Refuse new requests and wait for the running ones; False if some were still running."""
        self.draining = True
        log.info("draining: %d request(s) running, waiting up to %.0f s", self.active, within)
        try:
            async with asyncio.timeout(within):
                await self._idle.wait()
        except TimeoutError:
            log.warning("shutdown timeout: %d request(s) still running are cut", self.active)
            return False
        return True
