"""Asking a replica's ``kvgate agent`` for a version's verified local copy, before the replica loads it.

The agent fetches the version from the object store, verifies its blake3 tree digest and answers the
directory's path; kvgate then loads from exactly ``<agent_root>/<digest>`` (``Replica.root_for``) and
nothing else: an answer naming another path is refused. Every refusal is an ``AdapterNotReady`` whose
message names the logical ID and the kind of failure, never the versioned name or an object key (those
go to the log); each ask is counted by outcome (``kvgate_agent_fetches``).
"""

from __future__ import annotations

import logging

import aiohttp

from gateway.core.errors import AdapterNotReady, MalformedAnswer
from gateway.core.model import VersionState
from gateway.fleet.backends import answers
from gateway.fleet.replicas import Replica
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

_WHY = {
    "changed": "its stored bytes failed verification",
    "bad-manifest": "its stored bytes failed verification",
    "truncated": "its stored bytes are incomplete",
    "missing": "its stored bytes are missing",
    "unreachable": "the adapter store cannot be reached",
    "disk-full": "a replica has no disk space for it",
    "budget": "a replica has no disk space for it",
}
_AGENT_FAULT = "a replica's adapter agent did not deliver it"


async def ready_path(
    session: aiohttp.ClientSession,
    replica: Replica,
    version: VersionState,
    *,
    token: str,
    within: float,
    metrics: Metrics,
) -> str:
    """The verified local directory REPLICA loads VERSION from, or ``AdapterNotReady``."""
    if replica.agent is None:
        return version.path
    digest = version.digest
    expected = replica.root_for(version.path)
    outcome, detail = "ready", ""
    try:
        async with session.post(
            f"{replica.agent}/v1/fetch",
            json={"digest": digest},
            headers={"Authorization": f"Bearer {token}"},
            timeout=aiohttp.ClientTimeout(total=within),
        ) as response:
            body = await response.read()
            if response.status != 200:
                outcome, detail = (
                    answers.agent_refusal(body, response.status),
                    answers.reason_of(body, response.status),
                )
            else:
                path = answers.agent_path(answers.json_of(body), digest)
                if path != expected:
                    outcome, detail = (
                        "wrong-path",
                        f"it answered {path!r}, not {expected!r} (agent_root, replica_agents)",
                    )
    except MalformedAnswer as exc:
        outcome, detail = "malformed", exc.reason
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome, detail = "agent-unreachable", repr(exc)
    metrics.agent_fetches.labels(replica.url, outcome).inc()
    if outcome == "ready":
        return expected
    log.warning(
        "agent %s could not ready %s for %s (%s): %s",
        replica.agent,
        version.name,
        replica.url,
        outcome,
        detail,
    )
    raise AdapterNotReady(version.logical_id, _WHY.get(outcome, _AGENT_FAULT))
