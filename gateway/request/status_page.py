"""The operator's status page, ``GET /kvgate/``: one HTML file (``status_page.html``, inline CSS and JS, no
external assets) served beside ``/kvgate/status`` on the admin surface, and the fields it adds to that JSON.

How the token travels: the page itself holds no data and needs no token. Its script asks for the admin
token, keeps it in ``sessionStorage`` (this tab only, gone when the tab closes, never in a URL, a cookie
or a log line) and fetches ``/kvgate/status`` with the ``x-kvgate-admin-token`` header, which kvgate
compares in constant time (``Admin.check``); a refused token (401) is dropped and the data cleared. No
cookie means no ambient credential, so there is nothing for a cross-site request to ride on. The page is
sent with a strict Content-Security-Policy (its own inline script and style by hash, fetches to its own
origin only, no frames), ``no-store`` and ``no-referrer``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import Counter
from prometheus_client.metrics_core import Metric

from gateway.telemetry.metrics import Metrics

PATH = "/kvgate/"
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)

Verdicts = dict[str, dict[str, dict[str, Any]]]
"""logical ID -> replica URL -> the canary's last verdict there ({verdict, detail, name, at_ms})."""


@functools.cache
def page() -> tuple[str, str]:
    """The page's HTML and its Content-Security-Policy (the inline script and style allowed by hash)."""
    html = resources.files("gateway.request").joinpath("status_page.html").read_text("utf-8")
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for kind, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        hashes[kind].append(f"'sha256-{digest}'")
    scripts, styles = " ".join(hashes["script"]), " ".join(hashes["style"])
    policy = (
        f"default-src 'none'; script-src {scripts}; style-src {styles}; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html, policy


async def status_page(request: web.Request) -> web.Response:
    html, policy = page()
    headers = {
        "Content-Security-Policy": policy,
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
    }
    return web.Response(text=html, content_type="text/html", charset="utf-8", headers=headers)


def operator_fields(
    metrics: Metrics, verdicts: Verdicts, kv: Iterable[Metric] | None = None
) -> dict[str, Any]:
    """What ``/kvgate/status`` adds for the page: per logical ID, prompt and cached tokens (this kvgate's
    counters since it started), the canary's last verdict per replica, and the replicas' KV events from
    ``kv`` (the KV indexer's families; by default this registry's) with this process's precise claims."""
    own_claims = [*metrics.prefix_claimed_tokens.collect(), *metrics.prefix_confirmed_tokens.collect()]
    usage: dict[str, dict[str, float]] = {}
    for field, counter in (
        ("prompt_tokens", metrics.prompt_tokens),
        ("cached_tokens", metrics.cached_tokens),
    ):
        for logical_id, value in _totals(counter).items():
            usage.setdefault(logical_id, {"prompt_tokens": 0, "cached_tokens": 0})[field] = value
    return {
        "usage": usage,
        "audits": {logical_id: dict(by_replica) for logical_id, by_replica in verdicts.items()},
        "kv_events": kv_event_fields(metrics.registry.collect() if kv is None else [*kv, *own_claims]),
    }


KV_FIELDS = {
    "kvgate_kv_view_blocks": "blocks",
    "kvgate_kv_events": "events",
    "kvgate_kv_events_malformed": "malformed",
    "kvgate_kv_event_gaps": "gaps",
    "kvgate_kv_view_resets": "view_resets",
    "kvgate_kv_event_follower_errors": "follower_errors",
    "kvgate_kv_event_lag_seconds": "lag_seconds",
    "kvgate_kv_event_batches_dropped": "dropped_batches",
    "kvgate_prefix_claimed_tokens": "claimed_tokens",
    "kvgate_prefix_confirmed_tokens": "confirmed_tokens",
}


def kv_event_fields(families: Iterable[Metric]) -> dict[str, dict[str, float]]:
    """Per replica, what its KV events did (``kv.follower``, in the KV indexer; empty when ``kv_events``
    is off), from the indexer's metric families: blocks in its view, events, malformed ones, gaps, views
    emptied, follower failures, the last batch's lag, batches dropped while it lagged; and, from this
    process's own, the tokens precise decisions claimed there and the answers confirmed
    (``kv.live_check``)."""
    fields: dict[str, dict[str, float]] = {}
    for family in families:
        field = KV_FIELDS.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            replica = sample.labels.get("replica")
            if replica is None or sample.name.endswith("_created"):
                continue
            entry = fields.setdefault(replica, dict.fromkeys(KV_FIELDS.values(), 0.0))
            entry[field] += sample.value
    return fields


def _totals(counter: Counter) -> Mapping[str, float]:
    """A counter's ``_total`` per ``logical_id`` label (read from its samples, whatever else it is labelled
    by)."""
    totals: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            logical_id = sample.labels.get("logical_id")
            if sample.name.endswith("_total") and logical_id is not None:
                totals[logical_id] = totals.get(logical_id, 0.0) + sample.value
    return totals
