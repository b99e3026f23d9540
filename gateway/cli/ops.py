"""Operator commands: ``kvgate versions ID``, ``history ID``, ``status`` (the version x replica matrix),
``gc``, and the progress bar of ``publish``.

``status`` reads Redis (the epoch table and the listings every kvgate records for each replica, with a
TTL), so it needs no running kvgate and no admin token; a kvgate's own view is on its ``/kvgate/`` page.
Each command prints a table, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
from opentelemetry.sdk.trace import TracerProvider
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from gateway.adapters import gc
from gateway.adapters.stores import open_store
from gateway.cli.table_access import open_table
from gateway.core.base_print import short
from gateway.core.errors import BadRequest, KvgateError, ModelNotFound
from gateway.core.identity import ManifestEntry, check_logical_id
from gateway.core.model import VersionState
from gateway.core.split import DEFAULT_SPLIT, rollout_view
from gateway.core.wire import replica_id
from gateway.fleet.backends import dialect_for
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.inventory import read_versions
from gateway.table.leases import live_gateways
from gateway.table.rollout_gate import read_counts, read_holder

Common = Callable[[argparse.ArgumentParser, str], None]
_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)(?P<unit>[smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MIN_RETENTION_S = 60.0


def add_ops_parsers(commands: Any, common: Common) -> None:
    """``versions``, ``history``, ``status`` and ``gc`` under ``commands`` (the top parser's subparsers)."""
    versions = commands.add_parser("versions", help="a logical ID's published versions, newest first")
    common(versions, "versions")
    versions.add_argument("logical_id")
    history = commands.add_parser("history", help="a logical ID's history: publish, rollback, bump")
    common(history, "history")
    history.add_argument("logical_id")
    status = commands.add_parser("status", help="logical IDs x replicas: the version each replica has loaded")
    common(status, "status")
    collect = commands.add_parser(
        "gc", help="remove store entries nothing needs (see gateway/adapters/gc.py)"
    )
    common(collect, "gc")
    collect.add_argument("--keep", type=int, default=3, help="keep each logical ID's last N versions (3)")
    collect.add_argument("--older-than", default="7d", help="retention: remove only older entries (7d)")
    collect.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``: seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise BadRequest(
            f"--older-than {text!r}: give a number with s, m, h or d (e.g. 7d)", param="older_than"
        )
    return float(match["n"]) * _UNIT_S[match["unit"]]


def _when(ms: float) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


async def cmd_versions(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    logical_id = check_logical_id(args.logical_id)
    async with open_table(settings, tracing) as table:
        records = await read_versions(table, logical_id)
        state = await table.read_state(logical_id)
    if not records:
        raise ModelNotFound(f"logical ID {logical_id!r} has no published version", param="logical_id")
    current = (state.base, state.digest) if state else None
    c = state.candidate if state else None
    candidate = (c.base, c.digest) if c else None
    rows = [{**r.to_json(), "current": (r.base, r.digest) == current,
             "candidate": (r.base, r.digest) == candidate} for r in records]  # fmt: skip
    if args.json:
        epoch = state.epoch if state else None
        rollout = rollout_view(state) if state else None
        print(json.dumps({"logical_id": logical_id, "epoch": epoch, "versions": rows, "rollout": rollout},
                         indent=2))  # fmt: skip
        return
    print(f"{'':2}{'DIGEST':<18}{'PUBLISHED (UTC)':<21}{'BASE':<20}NAME")
    for row in rows:
        mark = "*" if row["current"] else "+" if row["candidate"] else ""
        when = _when(row["published_ms"])
        print(f"{mark:<2}{row['digest'][:16]:<18}{when:<21}{row['base']:<20}{row['name']}")
    print(f"\n(*: the current version, epoch {state.epoch})" if state else "\nno current version")
    if state and state.candidate:
        print(f"(+: the rollout's candidate)\n{describe_rollout(state)}")
    elif state and state.last_rollout:
        print(f"last rollout: {_last(state.last_rollout)}")


async def cmd_history(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    logical_id = check_logical_id(args.logical_id)
    malformed: list[str] = []
    async with open_table(settings, tracing) as table:
        events = await table.read_history(logical_id, malformed)
    if not events and not malformed:
        raise ModelNotFound(f"logical ID {logical_id!r} has no history", param="logical_id")
    if args.json:
        print(json.dumps({"logical_id": logical_id, "history": events, "malformed": malformed}, indent=2))
        return
    print(f"{'AT (UTC)':<21}{'EPOCH':>5}  {'ACTION':<10}{'DIGEST':<18}BASE")
    for e in events:
        at, digest = _when(e.get("at_ms", 0)), str(e.get("digest", ""))[:16]
        extra = ""
        if e.get("role") == "candidate":  # a rollout's event: its weight, and why it ended
            extra = (
                f"  candidate at {e.get('weight', 0) / 100:g}%"
                + (f", split by {e['split']}" if e.get("split") else "")
                + (f": {e['reason']}" if e.get("reason") else "")
            )
        print(
            f"{at:<21}{e.get('epoch', ''):>5}  {e.get('action', ''):<10}{digest:<18}{e.get('base', '')}"
            + extra
        )
    _print_skipped(malformed)


def _print_skipped(malformed: list[str]) -> None:
    """``history`` and ``gc`` name the entries they skipped (written by hand: not what kvgate writes)."""
    if malformed:
        print(f"\nskipped {len(malformed)} malformed history entries (not what kvgate writes):")
    for reason in malformed:
        print(f"  {reason}")


def _holds(root: str | None, path: str, digest: str) -> bool:
    """A replica that lists a version under ROOT holds the version stored at PATH: the same path, or, with an
    object store, its agent's verified copy (``<local dir>/<digest>``)."""
    return root == path or (root is not None and "://" in path and root.rpartition("/")[2] == digest)


async def cmd_status(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    async with open_table(settings, tracing) as table:
        view = await table.read_all()
        loaded = await table.read_loaded()
        gateways = await live_gateways(table)
        gates = {
            s.logical_id: await _gate_of(table, s.logical_id, s.candidate.digest)
            for s in view.states.values()
            if s.candidate is not None
        }
    replicas = sorted(loaded)
    rows: list[dict[str, Any]] = []
    for state in view.states.values():
        cells = {}
        for url in replicas:
            held = sorted(name for name in loaded[url] if name.startswith(f"{state.logical_id}@"))
            current = _holds(loaded[url].get(state.name), state.path, state.digest)
            served = {v.name for v in state.versions()}  # a rollout's candidate is no mismatch
            cand = state.candidate
            candidate = cand is not None and _holds(loaded[url].get(cand.name), cand.path, cand.digest)
            cells[url] = {"loaded": held, "current": current, "candidate": candidate,
                          "mismatch": any(n not in served for n in held)}  # fmt: skip
        rows.append({"logical_id": state.logical_id, "digest": state.digest, "name": state.name,
                     "epoch": state.epoch, "base": state.base, "base_print": short(state.base_print),
                     "path": state.path,
                     "loaded_on": [url for url in replicas if cells[url]["current"]],
                     "replicas": cells, "rollout": rollout_view(state),
                     "gate": gates.get(state.logical_id)})  # fmt: skip
    if args.json:
        matrix = {
            "generation": view.generation,
            "replicas": replicas,
            "logical_ids": rows,
            "gateways": gateways,
            "malformed_rows": view.malformed,
        }
        print(json.dumps(matrix, indent=2))
        return
    print(f"generation {view.generation}")
    columns = [replica_id(url) for url in replicas]
    print(f"{'LOGICAL ID':<20} {'EPOCH':>5}  {'CURRENT':<17}" + "".join(f"{c:<20}" for c in columns))
    for row in rows:
        print(f"{row['logical_id']:<20} {row['epoch']:>5}  {row['digest'][:16]:<17}"
              + "".join(f"{_cell(row['replicas'][url]):<20}" for url in replicas))  # fmt: skip
    for row in rows:
        if row["rollout"] is not None:
            print(f"  {row['logical_id']} {describe_rollout(view.states[row['logical_id']])}")
            if row["gate"] is not None:
                print(f"    {describe_gate(row['gate'])}")
    for logical_id, reason in sorted(view.malformed.items()):
        print(f"{logical_id!r:<20} MALFORMED (left out of every snapshot): {reason}")
    print("\n= current version loaded, + the rollout's candidate, ! another version of the ID loaded "
          "(a mismatch), - none")  # fmt: skip
    for column, url in zip(columns, replicas, strict=True):
        print(f"  {column}  {url}")
    print(f"\n{len(gateways)} kvgate(s) alive")
    for gateway_id, doc in gateways.items():
        print(f"  {gateway_id} on {doc.get('host')} (pid {doc.get('pid')})")
        for finding in doc.get("quarantined", []):
            print(f"    QUARANTINED {finding['name']} on {finding['replica']}: {finding['reason']} "
                  f"(root {finding['root']})")  # fmt: skip
        for mismatch in doc.get("base_mismatches", []):
            print(f"    OTHER BASE on {mismatch['replica']} ({mismatch['replica_print']}): not serving "
                  f"{mismatch['logical_id']}: {mismatch['reason']}")  # fmt: skip
        for found in doc.get("base_disagreements", []):
            pairs = zip(found.get("replicas", []), found.get("prints", []), strict=False)
            which = " vs ".join(f"{url} ({short})" for url, short in pairs)
            print(f"    BASE PRINTS DISAGREE ({found.get('kind')}) for base {found.get('base')!r}: {which}: "
                  f"{found.get('detail')}")  # fmt: skip


def describe_rollout(state: VersionState) -> str:
    c = state.candidate
    if c is None:
        return ""
    return (f"rollout: {c.name} (candidate, epoch {state.epoch + 1}) at {c.weight / 100:g}%, "
            f"{state.name} (current, epoch {state.epoch}) at {(10_000 - c.weight) / 100:g}%, "
            f"split by {c.split or DEFAULT_SPLIT}")  # fmt: skip


async def _gate_of(table: EpochTable, logical_id: str, digest: str) -> dict[str, Any]:
    """A running rollout's gate as Redis holds it: who holds it, and the fleet-wide figures."""
    holder, figures = (
        await read_holder(table, logical_id, digest),
        await read_counts(table, logical_id, digest),
    )
    return {"holder": holder.holder if holder is not None else None,
            "until_ms": holder.until_ms if holder is not None else None,
            "last_round_ms": holder.round_ms or None if holder is not None else None,
            "figures": {role: f.to_json() for role, f in figures.items()}}  # fmt: skip


def describe_gate(gate: dict[str, Any]) -> str:
    """One line: which kvgate process gates the rollout, and the error rates it judges (every kvgate's)."""
    held = f"held by {gate['holder']}" if gate["holder"] else "not held (no kvgate runs the gate now)"
    rates = ", ".join(
        f"{role} {f['errors']}/{f['requests']} errors ({f['error_rate']:.1%})"
        for role, f in sorted(gate["figures"].items())
    )
    return f"gate {held}; across the fleet: {rates}"


def _last(text: str) -> str:
    doc = json.loads(text)
    when = _when(doc.get("at_ms", 0))
    why = f": {doc['reason']}" if doc.get("reason") else ""
    return f"{doc.get('outcome', '?')} {str(doc.get('digest', ''))[:16]} at {when} UTC{why}"


def _cell(cell: dict[str, Any]) -> str:
    others = [name.split("@", 1)[1][:16] for name in cell["loaded"]]
    if cell["mismatch"]:
        return "!" + ",".join(others)
    return ("=" if cell["current"] else "") + ("+" if cell.get("candidate") else "") or "-"


async def cmd_gc(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> None:
    retention = parse_duration(args.older_than)
    if retention < MIN_RETENTION_S:
        raise BadRequest(f"--older-than must be at least {MIN_RETENTION_S:g} s (a publish must fit in it)")
    if args.keep < 1:
        raise BadRequest("--keep must be at least 1", param="keep")
    listings = await _live_listings(settings)
    store = open_store(settings.store)
    async with open_table(settings, tracing) as table:
        report = await gc.sweep(table, store, gc.Policy(args.keep, retention), listings, dry_run=args.dry_run)
    removable = [e for e in report.entries if not e.kept_because]
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "entries": [e.to_json() for e in report.entries],
                          "removed": report.removed, "restored": report.restored,
                          "leftovers": [item.to_json() for item in report.leftovers],
                          "malformed_history": report.malformed_history}, indent=2))  # fmt: skip
        return
    print(f"{'DIGEST':<18}{'AGE':>8}  {'BYTES':>12}  KEPT BECAUSE")
    for entry in report.entries:
        why = ", ".join(entry.kept_because) or ("would remove" if args.dry_run else "removed")
        if entry.digest in report.restored:
            why = "needed again meanwhile: kept"
        print(f"{entry.digest[:16]:<18}{entry.age_s / 86400:>7.1f}d  {entry.bytes:>12}  {why}")
    for item in report.leftovers:
        done = "would remove" if args.dry_run else "removed"
        print(f"{'(staging)':<18}{item.age_s / 86400:>7.1f}d  {item.bytes:>12}  {done}: {item.path}")
    freed = sum(e.bytes for e in removable if e.digest in report.removed)
    freed += 0 if args.dry_run else sum(item.bytes for item in report.leftovers)
    verb = f"would remove {len(removable)}" if args.dry_run else f"removed {len(report.removed)}"
    staged = f", and {len(report.leftovers)} killed publishes' staging" if report.leftovers else ""
    print(f"\n{verb} of {len(report.entries)} store entries{staged} ({freed} bytes freed)")
    _print_skipped(report.malformed_history)


async def _live_listings(settings: Settings) -> dict[str, dict[str, str]]:
    """What each configured replica lists right now; one that does not answer stops gc (exit 1)."""
    if not settings.replicas:
        return {}
    dialect = dialect_for(settings.backend)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout,
                                    sock_read=settings.read_timeout)  # fmt: skip
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            listings = await asyncio.gather(
                *(dialect.list_adapters(session, url) for url in settings.replicas)
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KvgateError(f"a replica did not list its adapters, nothing removed: {exc!r}") from exc
    return {url: listing.adapters for url, listing in zip(settings.replicas, listings, strict=True)}


@contextlib.contextmanager
def publish_progress(wanted: bool, manifest: list[ManifestEntry]) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr for the store copy, when stderr is a terminal or WANTED (``--progress``)."""
    if not (wanted or sys.stderr.isatty()):
        yield None
        return
    columns = ("copying {task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=Console(file=sys.stderr, force_terminal=wanted or None)) as bar:
        task = bar.add_task("adapter", total=sum(entry.size for entry in manifest))
        yield lambda n: bar.advance(task, n)
