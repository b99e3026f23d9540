"""``make deploy-smoke``: the manifests as pods with the real vLLM CPU image (minutes; not in ``make test``).

For each shape (deploy/local/sidecar, then deploy/local/ingress): render with ``kubectl kustomize``, play
with podman (scripts/kube_play.py, its adjustments in docs/deploy.md), the claim vllm-models filled with the
fixture's tiny model at /models/base, then scripts/pod_scenario.py (a completion for a logical ID through
each kvgate's container port, publish/rollback/bump, a Redis master failover), then everything removed.
Take /tmp/kvgate-vllm.lock around it (the Makefile does): each vLLM pod is ~3 GB.

    python -m scripts.deploy_smoke --fixture-dir .cache/fixture [--shape sidecar] [--sidecar-replicas 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from scripts import images, kube_play, pod_scenario

ROOT = Path(__file__).resolve().parent.parent
STATE = "exit {{.State.ExitCode}}, OOM-killed {{.State.OOMKilled}}, restarts {{.RestartCount}}"


def say(line: str) -> None:
    print(line, flush=True)


async def smoke(shape: str, fixture: Path, workdir: Path, built: dict[str, str]) -> None:
    docs = kube_play.render(ROOT / "deploy/local" / shape)
    played = kube_play.plan(docs, f"kvgate-smoke-{shape}", namespace="smoke-", images=built)
    say(f"== {shape}: pods {', '.join(p.name for p in played.pods)}")
    say(f"   not acted on: {', '.join(played.ignored)}")
    (secret,) = played.secrets
    started = time.monotonic()
    try:
        kube_play.up(played, workdir / shape, {"vllm-models": (fixture / "model", "base")})
        pods = pod_scenario.Pods(
            played, secret["stringData"]["token"], pod_scenario.kvgate_pods(played),
            pod_scenario.replica_pods(played), lambda line: say(f"   {line}"),
        )  # fmt: skip
        v1, v2 = fixture / "adapters" / "v1", fixture / "adapters" / "v2"
        await pod_scenario.run(pods, v1, v2, within=900)
        say(f"   {shape}: passed in {time.monotonic() - started:.0f} s")
    except BaseException:
        logs = workdir / shape / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for p in played.pods:
            for container in ("kvgate", "vllm", "redis", "sentinel"):
                name = f"{p.name}-{container}"
                done = kube_play.podman("logs", name, check=False)
                if done.returncode != 0:
                    continue
                text = (done.stdout + done.stderr).decode(errors="replace")
                (logs / f"{name}.log").write_text(text)
                state = (
                    kube_play.podman("inspect", "--format", STATE, name, check=False).stdout.decode().strip()
                )
                errors = [line for line in text.splitlines() if "Error" in line or "ERROR" in line][-8:]
                say(f"--- {name} ({state}; whole log in {logs / name}.log)")
                say("\n".join(errors or text.splitlines()[-8:]))
        raise
    finally:
        kube_play.down(played, workdir / shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture-dir", type=Path, required=True)
    parser.add_argument("--shape", action="append", choices=["sidecar", "ingress"])
    parser.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "deploy-smoke")
    args = parser.parse_args(argv)
    built: dict[str, str] = {}
    for name in ("kvgate", "redis", "vllm"):
        tag = images.IMAGES[name].tag
        built[tag] = images.build(name, quiet=True)
        say(f"image {tag}: {built[tag][:12]} (from this tree, layer cache)")
    failed = False
    for shape in args.shape or ["sidecar", "ingress"]:
        try:
            asyncio.run(smoke(shape, args.fixture_dir.resolve(), args.workdir, built))
        except pod_scenario.ScenarioFailed as error:
            say(f"   {shape}: FAILED: {error}")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
