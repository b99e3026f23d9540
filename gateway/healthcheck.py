"""``python -m gateway.healthcheck``: the image's ``HEALTHCHECK`` and Kubernetes' liveness probe (stdlib).

Ready (the default): exit 0 when ``/healthz`` answers 200 (a healthy replica, not draining).
``--alive``: exit 0 when ``/healthz`` answers at all, 200 or its 503 (draining, or no healthy replica yet):
the process serves HTTP, and a restart would help neither case. With ``--workers``, a worker's answer
that its parent does not answer (``parent: {"state": "not answering"}``: stopped or stuck, so nothing
restarts workers or drains on SIGTERM) is not alive. Anything else (refused, timed out, another
status, not kvgate's answer) exits 1 with one line on stderr. The URL defaults to this container's kvgate
(``KVGATE_PORT``, else 8080, on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def default_url() -> str:
    return f"http://127.0.0.1:{os.environ.get('KVGATE_PORT', '8080')}/healthz"


def check(url: str, *, alive: bool, timeout: float) -> str | None:
    """None when the check holds, else why not (one line)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    except (OSError, ValueError) as error:
        return f"{url}: no answer ({error})"
    if status == 200:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "draining" not in doc:
        return f"{url}: HTTP {status}"
    parent = doc.get("parent")
    if isinstance(parent, dict) and parent.get("state") == "not answering":
        return f"{url}: HTTP {status}, the workers' parent does not answer"
    if alive and status == 503:
        return None
    return f"{url}: HTTP {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.healthcheck", description="Check kvgate's /healthz."
    )
    parser.add_argument("--url", default=default_url(), help="kvgate's /healthz (default: %(default)s)")
    parser.add_argument("--alive", action="store_true", help="any answer of kvgate's (200 or 503) will do")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    problem = check(args.url, alive=args.alive, timeout=args.timeout)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
