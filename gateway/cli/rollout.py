"""``kvgate rollout ID SOURCE --percent P [--split-key K]`` (a candidate beside the current version, its
requests split by K), ``kvgate rollout ID --percent P`` (its new weight), ``kvgate promote ID`` and
``kvgate abort ID``: each one script of ``lua/`` (``table/rollouts.py``), so each is also one
``redis-cli --eval`` of ``kvgate script NAME``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from gateway.adapters.publish import rollout_adapter
from gateway.adapters.source import local_source
from gateway.adapters.stores import open_store
from gateway.cli.base_model import choose_base
from gateway.cli.table_access import open_table
from gateway.core.base_print import short
from gateway.core.errors import BadRequest
from gateway.core.identity import check_logical_id, versioned_name
from gateway.core.split import DEFAULT_SPLIT, SPLIT_KEYS
from gateway.settings.model import Settings
from gateway.table import rollouts

Common = Callable[[argparse.ArgumentParser, str], None]


def add_rollout_parsers(commands: Any, common: Common) -> None:
    rollout = commands.add_parser(
        "rollout", help="roll a new version out to a share of an ID's traffic (or change the share)"
    )
    common(rollout, "rollout")
    rollout.add_argument("logical_id")
    rollout.add_argument(
        "adapter_dir",
        nargs="?",
        help="the candidate: a directory or s3://BUCKET/PATH (omit: change the weight)",
    )
    rollout.add_argument("--percent", type=float, required=True, help="the candidate's share, 0..100")
    rollout.add_argument("--base", help="the served base model it is for (default: the only one served)")
    rollout.add_argument(
        "--split-key",
        help=f"what requests are split by: {', '.join(SPLIT_KEYS)} (default: {DEFAULT_SPLIT}; a new "
        "rollout only; docs/operator-guide.md says what each costs in cache reuse)",
    )
    promote = commands.add_parser("promote", help="make the running rollout's candidate current")
    common(promote, "promote")
    promote.add_argument("logical_id")
    promote.add_argument("--digest", default="", help="only if the candidate is this digest (or prefix)")
    abort = commands.add_parser("abort", help="end the running rollout: the current version serves all")
    common(abort, "abort")
    abort.add_argument("logical_id")
    abort.add_argument("--digest", default="", help="only if the candidate is this digest (or prefix)")
    abort.add_argument("--reason", default="operator", help="kept in the history (default: operator)")


def percent(weight: int) -> str:
    return f"{weight / 100:g}%"


def _emit(args: argparse.Namespace, doc: dict[str, Any], line: str) -> None:
    print(json.dumps(doc, indent=2) if args.json else line)


async def cmd_rollout(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    logical_id = check_logical_id(args.logical_id)
    weight = rollouts.weight_of(args.percent)  # bad input refused before anything starts
    if args.adapter_dir is None:
        for flag, value in (("--base", args.base), ("--split-key", args.split_key)):
            if value:
                raise BadRequest(f"{flag} goes with a SOURCE directory (a new rollout)", param=flag[2:])
        async with open_table(settings, tracing) as table:
            change = await rollouts.set_weight(table, logical_id, weight)
        verb = "weight changed" if change.changed else "unchanged"
        doc = {"logical_id": logical_id, "weight": change.weight, "changed": change.changed}
        _emit(args, doc, f"{verb}: {logical_id} candidate at {percent(change.weight)}")
        return
    rollouts.split_of(args.split_key)  # refused before anything is stored
    store = open_store(settings.store, max_bytes=settings.max_adapter_bytes)
    with local_source(args.adapter_dir, max_bytes=settings.max_adapter_bytes) as source:
        manifest = store.scan(source)
        base = await choose_base(settings, args.base)
        async with open_table(settings, tracing) as table:
            done = await rollout_adapter(table, store, logical_id, source, base.identity, weight,
                                         manifest=manifest, base_print=base.print,
                                         split=args.split_key, base_dir=base.directory)  # fmt: skip
    verb = "rollout started" if done.change.changed else "unchanged (already the candidate at that weight)"
    doc = {"logical_id": logical_id, "digest": done.digest, "name": done.name, "path": str(done.path),
           "weight": done.change.weight, "epoch": done.change.epoch + 1, "changed": done.change.changed,
           "base": base.identity, "base_print": short(base.print),
           "split_key": done.change.split}  # fmt: skip
    _emit(args, doc, f"{verb}: {logical_id} -> {done.name} at {percent(weight)} "
                     f"(epoch {done.change.epoch + 1}, split by {done.change.split})")  # fmt: skip
    if base.note:
        print(f"note: {base.note}", file=sys.stderr)


async def cmd_promote(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    logical_id = check_logical_id(args.logical_id)
    async with open_table(settings, tracing) as table:
        change = await rollouts.promote(table, logical_id, args.digest)
    name = versioned_name(logical_id, change.digest)
    doc = {"logical_id": logical_id, "digest": change.digest, "name": name, "epoch": change.epoch}
    _emit(args, doc, f"promoted: {logical_id} -> {name} epoch {change.epoch}")


async def cmd_abort(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    logical_id = check_logical_id(args.logical_id)
    async with open_table(settings, tracing) as table:
        change = await rollouts.abort(table, logical_id, args.reason, args.digest)
    name = versioned_name(logical_id, change.digest)
    doc = {"logical_id": logical_id, "aborted": name, "digest": change.digest, "epoch": change.epoch}
    _emit(
        args,
        doc,
        f"aborted: {logical_id} rollout of {name}; the current version serves all (epoch {change.epoch})",
    )
