"""``kvgate audit``: the cold-versus-warm audit of a deployment, through kvgate or straight to servers."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

import aiohttp
from opentelemetry.sdk.trace import TracerProvider

from gateway.adapters.publish import publish_adapter
from gateway.adapters.stores import open_store
from gateway.cli.table_access import open_table
from gateway.core.errors import BadRequest
from gateway.core.identity import check_logical_id
from gateway.proof.audit import (
    CANNOT_AUDIT,
    AuditTarget,
    DirectTarget,
    GatewayTarget,
    Verdict,
    audit_before_after,
    audit_round,
    faulty,
    render,
    run_shell,
)
from gateway.proof.audit import to_json as audit_json
from gateway.settings.model import Settings
from gateway.telemetry.tracing import tracer_from


async def cmd_audit(args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None) -> int:
    """Exit 0 when every verdict is coherent, 3 when the audit found a fault, 4 when it could not audit
    (the server's context cannot hold a probe over two KV blocks)."""
    target, update = _audit_plan(args, settings, tracing)
    timeout = aiohttp.ClientTimeout(
        total=None, connect=settings.connect_timeout, sock_read=settings.read_timeout
    )
    rounds: dict[str, list[Verdict]] = {}
    async with aiohttp.ClientSession(timeout=timeout) as http:
        with tracer_from(tracing).start_as_current_span("kvgate.audit") as span:
            if args.before_after:
                before, after = await audit_before_after(http, target, lambda: update(http), colds=args.colds)
                rounds = {"before": before, "after": after}
            else:
                verdicts = await audit_round(
                    http, target, colds=args.colds, expected_digest=args.expect_digest
                )
                rounds = {"audit": verdicts}
            span.set_attribute("kvgate.audit.verdicts", [v.verdict for vs in rounds.values() for v in vs])
    if args.json:
        print(audit_json(rounds))
    else:
        print("\n\n".join(render(name, verdicts) for name, verdicts in rounds.items()))
    if any(faulty(verdicts) for verdicts in rounds.values()):
        return 3
    every = [v.verdict for verdicts in rounds.values() for v in verdicts]
    return 4 if CANNOT_AUDIT in every else 0


UpdateStep = Callable[[aiohttp.ClientSession], Awaitable[str | None]]


def _audit_plan(
    args: argparse.Namespace, settings: Settings, tracing: TracerProvider | None
) -> tuple[AuditTarget, UpdateStep]:
    """Which deployment to audit, and what ``--before-after`` runs between the two rounds."""
    if args.direct:
        if not args.model or args.logical_id or args.gateway:
            raise BadRequest("--direct needs --model NAME and no logical ID or --gateway")
        if args.before_after and not args.reload_cmd:
            raise BadRequest("--before-after with --direct needs --reload-cmd")

        async def reload(http: aiohttp.ClientSession) -> str | None:
            await run_shell(args.reload_cmd)
            return str(args.expect_digest) if args.expect_digest else None

        return DirectTarget(tuple(url.rstrip("/") for url in args.direct), args.model), reload
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    if not (args.logical_id and args.gateway and token):
        raise BadRequest(
            "audit a logical ID with --gateway URL and an admin token, or a raw server with --direct"
        )
    if args.before_after and not args.publish:
        raise BadRequest("--before-after through kvgate needs --publish ADAPTER_DIR")
    target = GatewayTarget(args.gateway.rstrip("/"), check_logical_id(args.logical_id), token)

    async def publish(http: aiohttp.ClientSession) -> str | None:
        async with open_table(settings, tracing) as table:
            store = open_store(settings.store, max_bytes=settings.max_adapter_bytes)
            done = await publish_adapter(
                table, store, target.logical_id, args.publish, settings.base_identity
            )
        await target.until_serving(http, done.digest, within=settings.reconcile_interval * 10 + 5)
        return done.digest

    return target, publish
