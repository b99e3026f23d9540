"""``kvgate``: serve, publish, rollback, bump, audit (``cli/audit.py``), demo, keys (``cli/keys.py``),
status, versions, history, gc (``cli/ops.py``), rollout, promote, abort (``cli/rollout.py``), script.

Every option also reads from ``KVGATE_<NAME>`` and from a TOML config file (``--config``).
Errors print one line to stderr and exit non-zero (2 for bad input, 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import uvloop
from opentelemetry.sdk.trace import TracerProvider
from pydantic import ValidationError

from gateway.adapters.objstore import is_object_url
from gateway.adapters.publish import publish_adapter
from gateway.adapters.source import local_source
from gateway.adapters.stores import open_store
from gateway.app.keys import ADMIN_LISTENER, DRAIN, METRICS
from gateway.app.wiring import build_app, local_health
from gateway.cli.agent import cmd_agent
from gateway.cli.audit import cmd_audit
from gateway.cli.base_model import choose_base
from gateway.cli.keys import add_keys_parser, check_keys_arguments, run_keys_command
from gateway.cli.ops import add_ops_parsers, cmd_gc, cmd_history, cmd_status, cmd_versions, publish_progress
from gateway.cli.rollout import add_rollout_parsers, cmd_abort, cmd_promote, cmd_rollout
from gateway.cli.table_access import open_table
from gateway.core.base_print import short
from gateway.core.errors import BadRequest, KvgateError
from gateway.core.identity import check_logical_id, versioned_name
from gateway.fleet.backends import dialect_for
from gateway.process.http_edge import running
from gateway.process.parent import WorkerPlace, run_workers, worker_count
from gateway.settings.config_file import describe_invalid
from gateway.settings.flags import add_setting_flags, flag_overrides, unknown_environment
from gateway.settings.model import Settings, load_settings
from gateway.table.callers import CallerTable
from gateway.table.scripts import assemble_script, operation_names
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.tracing import tracer_provider_from_env


def _common(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (env: KVGATE_CONFIG)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_setting_flags(parser, command)  # one flag per setting the command uses, from the Settings model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    _common(serve, "serve")
    _common(
        commands.add_parser("agent", help="run the sidecar that fetches verified versions for a replica"),
        "agent",
    )

    publish = commands.add_parser("publish", help="publish an adapter directory as the current version")
    _common(publish, "publish")
    publish.add_argument("logical_id")
    publish.add_argument("adapter_dir", help="a local adapter directory, or s3://BUCKET/PATH to download one")
    publish.add_argument("--progress", action="store_true", help="a progress bar even when not on a terminal")
    publish.add_argument(
        "--base", help="the served base model it is for (default: the only one the replicas serve)"
    )

    rollback = commands.add_parser("rollback", help="point a logical ID back at an earlier version")
    _common(rollback, "rollback")
    rollback.add_argument("logical_id")
    rollback.add_argument("digest", nargs="?", default="", help="digest or unique prefix; default: previous")

    bump = commands.add_parser("bump", help="new epoch (new cache namespace) for a logical ID")
    _common(bump, "bump")
    bump.add_argument("logical_id")

    audit = commands.add_parser("audit", help="cold-versus-warm coherence audit, per replica")
    _common(audit, "audit")
    audit.add_argument("logical_id", nargs="?", help="audit this logical ID through --gateway")
    audit.add_argument("--gateway", help="kvgate URL (needs --admin-token / KVGATE_ADMIN_TOKEN)")
    audit.add_argument("--direct", action="append", help="a raw server URL (repeat); no kvgate involved")
    audit.add_argument("--model", help="with --direct: the adapter name on the server(s)")
    audit.add_argument("--before-after", action="store_true", help="audit, run the update, audit again")
    audit.add_argument(
        "--publish", type=Path, help="through kvgate: the update publishes this adapter directory"
    )
    audit.add_argument("--reload-cmd", help="with --direct: the update is this shell command")
    audit.add_argument("--colds", type=int, default=2, help="cold runs per replica (calibrate the tolerance)")
    audit.add_argument(
        "--expect-digest", help="the digest every replica should serve (default: the majority)"
    )

    demo = commands.add_parser("demo", help="the fault and the cure, side by side, on real vLLM replicas")
    _common(demo, "demo")
    demo.add_argument("--vllm-python", type=Path, required=True, help="python of the vLLM CPU virtualenv")
    demo.add_argument("--fixture-dir", type=Path, required=True, help="tiny model and adapters")

    add_keys_parser(commands, lambda parser: _common(parser, "keys"))
    add_ops_parsers(commands, _common)
    add_rollout_parsers(commands, _common)

    script = commands.add_parser("script", help="print an epoch table Lua script whole, for redis-cli --eval")
    script.add_argument("name", choices=operation_names(), help="lua/NAME.lua")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    """The command's settings: its flags (exactly those it has) over the environment over the config file."""
    env_config = os.environ.get("KVGATE_CONFIG")
    config_file = args.config or (Path(env_config) if env_config else None)
    try:
        return load_settings(flag_overrides(args, args.command), config_file)
    except ValidationError as exc:
        raise BadRequest(describe_invalid(exc, Settings.model_fields.keys())) from exc


def _emit(args: argparse.Namespace, doc: dict[str, Any], line: str) -> None:
    print(json.dumps(doc, indent=2) if args.json else line)


async def cmd_publish(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    check_logical_id(args.logical_id)  # refuse bad input before anything starts or is written
    store = open_store(settings.store, max_bytes=settings.max_adapter_bytes)
    with local_source(args.adapter_dir, max_bytes=settings.max_adapter_bytes) as source:
        manifest = store.scan(source)
        base = await choose_base(settings, args.base)
        with publish_progress(args.progress, manifest) as progress:
            async with open_table(settings, tracing) as table:
                done = await publish_adapter(
                    table, store, args.logical_id, source, base.identity, manifest=manifest,
                    progress=progress, base_print=base.print, base_dir=base.directory,
                )  # fmt: skip
    verb = "published" if done.change.changed else "unchanged (already current)"
    doc = {"logical_id": done.logical_id, "digest": done.digest, "name": done.name,
           "path": str(done.path), "epoch": done.change.epoch, "changed": done.change.changed,
           "base": base.identity, "base_print": short(base.print)}  # fmt: skip
    _emit(args, doc, f"{verb}: {done.logical_id} -> {done.name} epoch {done.change.epoch} ({done.path})")
    if base.note:
        print(f"note: {base.note}", file=sys.stderr)
    if not dialect_for(settings.backend).runtime_loading:
        print(
            f"note: {settings.backend} replicas cannot load adapters at runtime; kvgate routes "
            f"{done.logical_id} only to replicas started with {done.name} from {done.path}",
            file=sys.stderr,
        )


async def cmd_rollback(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    logical_id = check_logical_id(args.logical_id)
    async with open_table(settings, tracing) as table:
        current = await table.read_state(logical_id)  # a rollback stays within the current base
        base = current.base if current is not None else settings.base_identity
        change = await table.rollback(logical_id, args.digest, base)
    name = versioned_name(logical_id, change.digest)
    verb = "rolled back" if change.changed else "unchanged (already current)"
    doc = {"logical_id": logical_id, "digest": change.digest, "name": name, "epoch": change.epoch,
           "changed": change.changed, "base": base}  # fmt: skip
    _emit(args, doc, f"{verb}: {logical_id} -> {name} epoch {change.epoch}")


async def cmd_bump(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    logical_id = check_logical_id(args.logical_id)
    async with open_table(settings, tracing) as table:
        change = await table.bump(logical_id)
    _emit(
        args, {"logical_id": logical_id, "epoch": change.epoch}, f"bumped: {logical_id} epoch {change.epoch}"
    )


async def cmd_serve(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    if not settings.replicas:
        raise KvgateError("no replicas: pass --replica URL (or KVGATE_REPLICAS)")
    if is_object_url(settings.store) and (alone := sorted(set(settings.replicas) - set(settings.agent_map))):
        raise KvgateError(
            f"the store is an object store: every replica needs a kvgate agent (replica_agents); "
            f"none for {', '.join(alone)}"
        )
    count = worker_count(settings)
    if count > 1:  # a parent of `count` workers (gateway/process/parent.py), each running `serve` below
        await run_workers(settings, tracing, count, args.argv)
    else:
        await serve(settings, tracing)


async def serve(settings: Settings, tracing: TracerProvider | None, place: WorkerPlace | None = None) -> None:
    """One kvgate until SIGTERM/SIGINT (then it drains); with ``place``, a worker of ``--workers``."""
    supervisor = Supervisor(failure_limit=settings.background_failure_limit)  # every background task's
    owner = supervisor if place is None else None  # a worker uses its parent's embedded Redis
    async with (
        open_table(settings, tracing, supervisor=owner) as table,
        contextlib.AsyncExitStack() as listeners,
    ):
        siblings = place.siblings if place else None
        app = build_app(
            settings, table.redis, tracer_provider=tracing, supervisor=supervisor, siblings=siblings,
            kv_index_fd=place.kv_index_fd if place else None,
        )  # fmt: skip
        log = logging.getLogger("gateway")
        if ADMIN_LISTENER in app:  # first: once /healthz answers on the API listener, every listener is up
            sock = place.admin if place else None
            admin = running(app[ADMIN_LISTENER], settings.admin_host, settings.admin_port, sock=sock)
            log.info("admin listener on %s", await listeners.enter_async_context(admin))
        api = running(app, settings.host, settings.port, sock=place.api if place else None)
        log.info("kvgate listening on %s", await listeners.enter_async_context(api))
        if place is not None:
            place.siblings.track(app[METRICS])
            views = place.siblings.serving(app[METRICS].exposition, lambda: local_health(app), supervisor)
            await listeners.enter_async_context(views)
            place.serving()  # the parent knows this worker started
        gc.freeze()  # what starting built lives as long as the process: no full collection walks it
        # again (they paused this loop 35-48 ms, under docs/edge-parsing.md's heavy bodies; 0.75 ms frozen)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(supervisor.wait_fatal())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for waiting in waits:
            waiting.cancel()
        await app[DRAIN].drain(settings.shutdown_timeout)  # /healthz 503 at once; running requests finish
        if supervisor.fatal_reason is not None:  # a task this process cannot work without keeps failing
            raise KvgateError(f"stopped: {supervisor.fatal_reason}")


async def cmd_keys(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    check_keys_arguments(args)  # before Redis is even started
    async with open_table(settings, tracing) as table:
        await run_keys_command(args, CallerTable(table.redis))


async def cmd_demo(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    from gateway.dev.demo import run_demo

    if not await run_demo(settings, vllm_python=args.vllm_python, fixture_dir=args.fixture_dir):
        raise KvgateError("the demo did not show the fault on the direct path and coherence through kvgate")


Command = Callable[[argparse.Namespace, Settings, TracerProvider | None], Coroutine[Any, Any, int | None]]
COMMANDS: dict[str, Command] = {
    "serve": cmd_serve,
    "agent": cmd_agent,
    "audit": cmd_audit,
    "publish": cmd_publish,
    "rollback": cmd_rollback,
    "bump": cmd_bump,
    "status": cmd_status,
    "versions": cmd_versions,
    "history": cmd_history,
    "gc": cmd_gc,
    "rollout": cmd_rollout,
    "promote": cmd_promote,
    "abort": cmd_abort,
    "demo": cmd_demo,
    "keys": cmd_keys,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what --workers' workers are started with
    if unknown := unknown_environment(os.environ):  # config fails closed: a typo must not mean a default
        print("\n".join(f"kvgate {args.command}: {line}" for line in unknown), file=sys.stderr)
        return 2
    if args.command == "script":  # needs no settings and no Redis: the text Redis would run
        print(assemble_script(args.name), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from(args)
        tracing = tracer_provider_from_env()  # OTEL_TRACES_EXPORTER etc.; None (off) by default
        command = COMMANDS[args.command](args, settings, tracing)
        try:
            code = uvloop.run(command) if args.command == "serve" else asyncio.run(command)
        finally:
            if tracing is not None:
                tracing.shutdown()  # flush what the batch processor holds
    except KvgateError as exc:
        print(f"kvgate {args.command}: {exc.message}", file=sys.stderr)
        return 2 if exc.status < 500 else 1
    except (OSError, ValueError) as exc:
        print(f"kvgate {args.command}: {exc}", file=sys.stderr)
        return 1
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
