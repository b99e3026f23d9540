"""The sidecar shape's manifests, as ``kubectl kustomize deploy/local/sidecar-stub`` renders them, played as
pods with podman (scripts/kube_play.py; its adjustments are listed in docs/deploy.md): two pods of kvgate
beside the stub replica image in place of vLLM, and the three Redis pods with their sentinels and init
script. scripts/pod_scenario.py drives them: completions for a logical ID through each kvgate's container
port, a publish in a kvgate pod, a rollback, a publish and a bump with redis-cli in the Redis master's pod,
and a failover of the Redis master's container with kvgate serving through it. ``make deploy-smoke`` plays
the same with the real vLLM CPU image (scripts/deploy_smoke.py).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import images, kube_play, pod_scenario
from tests.support.adapter_files import MakeAdapter

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kube_play.Plan]:
    for name in ("kvgate", "stub", "redis"):  # from this tree (layer cache), never a stale image
        images.build(name, quiet=True)
    plan = kube_play.plan(
        kube_play.render(ROOT / "deploy/local/sidecar-stub"), f"kvgate-test-{secrets.token_hex(3)}"
    )
    workdir = tmp_path_factory.mktemp("kube-play")
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text('{"model_type": "llama"}')  # the stub reads nothing: it is listed
    try:
        kube_play.up(plan, workdir, {"vllm-models": (model, "base")})
        yield plan
    finally:
        kube_play.down(plan, workdir)


def test_the_played_pods_are_the_rendered_workloads(played: kube_play.Plan) -> None:
    assert [p.name for p in played.pods] == [
        "vllm-kvgate-0",
        "vllm-kvgate-1",
        "redis-0",
        "redis-1",
        "redis-2",
    ]
    assert played.pod("redis-1").aliases == ["redis-1", "redis-1.redis-headless"]
    assert f"{played.namespace}data-redis-2" in played.claims
    assert f"{played.namespace}kvgate-adapters" in played.claims
    assert sorted(played.ignored) == sorted([
        "ServiceAccount/kvgate", "ServiceAccount/redis", "ServiceAccount/vllm", "Service/kvgate",
        "Service/kvgate-admin", "Service/redis-headless", "PodDisruptionBudget/kvgate",
        "PodDisruptionBudget/redis", "ServiceMonitor/kvgate", "NetworkPolicy/vllm-only-from-kvgate",
    ])  # fmt: skip
    seen = kube_play.podman(
        "exec", f"{played.namespace}vllm-kvgate-1-vllm", "cat", "/models/base/config.json"
    )
    assert seen.stdout == b'{"model_type": "llama"}', "claim vllm-models, filled before the play, at /models"
    (secret,) = played.secrets
    token = base64.b64decode(kube_play.secret_json(secret).decode().split('"')[3]).decode()
    assert token == secret["stringData"]["token"]


async def test_the_scenario_runs_on_the_sidecar_pods(
    played: kube_play.Plan, make_adapter: MakeAdapter
) -> None:
    seen: list[str] = []
    (secret,) = played.secrets
    pods = pod_scenario.Pods(played, secret["stringData"]["token"], pod_scenario.kvgate_pods(played),
                             pod_scenario.replica_pods(played), seen.append)  # fmt: skip
    try:
        await pod_scenario.run(pods, make_adapter(b"v1-bytes"), make_adapter(b"v2-bytes"), within=180)
    except BaseException:
        for p in played.pods:
            for container in ("kvgate", "vllm", "redis", "sentinel"):
                done = kube_play.podman("logs", "--tail", "15", f"{p.name}-{container}", check=False)
                print(f"--- {p.name}-{container}\n{done.stdout.decode()}{done.stderr.decode()}")
        raise
    finally:
        print("\n".join(seen))
    assert len(seen) == 7, seen
