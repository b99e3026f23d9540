"""``kvgate keys create|list|revoke``: API keys, a caller's tenant and the logical IDs it may use.

``create`` prints the key once (alone on stdout, so ``KEY=$(kvgate keys create ...)`` works; ``--json``
prints it with the rest) and Redis keeps only its hash; ``list`` never shows a key, only its id;
``revoke`` takes that id. Bad input is one line and exit 2, like every kvgate command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from gateway.core.errors import BadRequest
from gateway.table.callers import Caller, CallerTable, check_grant


def add_keys_parser(commands: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """``kvgate keys ...`` under ``commands`` (the top parser's subparsers); ``common`` adds the settings."""
    keys = commands.add_parser("keys", help="API keys: a caller's tenant and the logical IDs it may use")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", help="a new API key, printed once (Redis keeps its hash)")
    common(create)
    create.add_argument("--tenant", help="the caller's tenant (its own base-model cache namespace); required")
    create.add_argument(
        "--id", dest="ids", action="append", default=[], metavar="LOGICAL_ID", help="a logical ID it may use"
    )
    create.add_argument("--base", action="store_true", help="it may use the base model too")
    common(key_commands.add_parser("list", help="every key: id, tenant, logical IDs (never the key)"))
    revoke = key_commands.add_parser(
        "revoke", help="revoke a key (kvgates refuse it within reconcile_interval)"
    )
    common(revoke)
    revoke.add_argument("key_id", help="as `kvgate keys list` shows it")


def check_keys_arguments(args: argparse.Namespace) -> None:
    """Refuse bad input before Redis is even started (in one line: argparse's refusals take several)."""
    if args.keys_command != "create":
        return
    if not args.tenant:
        raise BadRequest("keys create needs --tenant NAME", param="tenant")
    check_grant(args.tenant, args.ids, base=args.base)


async def run_keys_command(args: argparse.Namespace, callers: CallerTable) -> None:
    if args.keys_command == "create":
        key, caller = await callers.create(args.tenant, args.ids, base=args.base)
        if args.json:
            print(json.dumps({"key": key, **caller.to_json()}, indent=2))
            return
        print(key)
        print(
            f"created key {caller.key_id} for {_allowed(caller)}; the key is shown only once", file=sys.stderr
        )
    elif args.keys_command == "revoke":
        caller = await callers.revoke(args.key_id)
        line = f"revoked key {caller.key_id} of {_allowed(caller)}"
        print(json.dumps(caller.to_json(), indent=2) if args.json else line)
    else:
        _list(args, *await callers.list())


def _allowed(caller: Caller) -> str:
    what = [*sorted(caller.ids), *(["the base model"] if caller.base else [])]
    return f"tenant {caller.tenant} ({', '.join(what)})"


def _list(args: argparse.Namespace, callers: list[Caller], malformed: dict[str, str]) -> None:
    """Every key; a row that is no key (written past ``kvgate keys``) is listed as MALFORMED, with why:
    kvgates refuse it, ``kvgate keys revoke`` deletes it."""
    if args.json:
        rows = [{"key_id": key_id, "malformed": why} for key_id, why in sorted(malformed.items())]
        print(json.dumps({"keys": [caller.to_json() for caller in callers], "malformed": rows}, indent=2))
        return
    print(f"{'KEY ID':<14} {'TENANT':<20} {'BASE':<5} LOGICAL IDS")
    for caller in callers:
        base = "yes" if caller.base else "no"
        print(f"{caller.key_id:<14} {caller.tenant:<20} {base:<5} {', '.join(sorted(caller.ids)) or '-'}")
    for key_id, why in sorted(malformed.items()):
        print(f"{key_id:<14} MALFORMED (refused by every kvgate): {why}")
