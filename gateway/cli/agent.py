"""``kvgate agent``: run the per-replica sidecar (``gateway.agent.server``) until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from opentelemetry.sdk.trace import TracerProvider

from gateway.agent.server import build_agent
from gateway.process.http_edge import running
from gateway.settings.model import Settings


async def cmd_agent(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    app = build_agent(
        settings.store,
        settings.agent_dir,
        token=settings.agent_token.get_secret_value() if settings.agent_token else "",
        replica_url=settings.agent_replica,
        agent_root=settings.agent_root,
        disk_bytes=settings.agent_disk_bytes,
    )
    async with running(app, settings.agent_host, settings.agent_port) as url:
        logging.getLogger("gateway").info(
            "kvgate agent listening on %s, keeping versions in %s", url, settings.agent_dir
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
