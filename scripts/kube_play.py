"""Plays what ``kubectl kustomize`` renders as podman pods (``podman kube play``), adjusted only where podman
4.3 cannot act on a kind; each adjustment is one function here and one line of docs/deploy.md:

- a StatefulSet is played as its pods ``NAME-0 .. NAME-(N-1)``, each with its claims from the
  volumeClaimTemplates (``TEMPLATE-NAME-i``), and a Deployment as ``replicas`` pods ``NAME-i`` (podman plays
  one pod per Deployment);
- a headless Service's per-pod DNS names (``NAME-i.SERVICE``) and a pod's own name are network aliases on
  one podman network with DNS (aardvark); other Services, PodDisruptionBudgets, NetworkPolicies,
  ServiceMonitors and ServiceAccounts are not acted on (there is no kube-proxy, no controller);
- a Secret is created with ``podman secret create`` as the flat JSON map (key to base64 value) podman 4.3
  reads for a secretKeyRef (a Secret in the played YAML it stores as YAML and cannot read back: ``secret
  ... is not valid JSON``);
- claims are podman volumes of the same names (pre-filled ones, e.g. the model, given by the caller);
- an emptyDir is a podman volume named after the pod's volume (``tmp``), so pods would share it: each pod's
  emptyDirs are renamed ``POD--VOLUME``, and removed with the pod; a ``medium: Memory`` one is a host
  directory of mode 1777 (``hostPath`` under the play's workdir), since podman gives a volume the owner and
  mode of the image's own directory there (``/dev/shm``: root, 0755, where vLLM's non-root user could not
  create its shared memory: ``PermissionError: '/psm_...'``), whatever the volume's options;
- podman 4.3 publishes every containerPort on the host (hostPort defaults to containerPort), so two pods with
  the same port cannot start: the ports are dropped (pods are reached at their own addresses on the
  network), named probe ports made numbers first;
- podman 4.3 applies the pod's restartPolicy (Always, all a workload may have) to its init containers too,
  restarting a finished init container until ``kube play`` fails: pods are played with ``OnFailure`` (a
  container that fails, or is killed, is still restarted; one stopped with ``podman stop`` stays down).

``python -m scripts.kube_play up|down KUSTOMIZATION [--seed CLAIM=DIR]`` (podman with
deploy/image/containers.conf, as scripts/images.py); tests/deploy/test_pods.py and scripts/deploy_smoke.py
use it.
"""

from __future__ import annotations

import argparse
import base64
import copy
import io
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scripts.images import podman_env

IGNORED = {"Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "ServiceAccount"}
Doc = dict[str, Any]


@dataclass
class PlayedPod:
    name: str
    labels: dict[str, str]
    aliases: list[str]
    spec: Doc

    def manifest(self, config_maps: list[Doc]) -> str:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": self.name, "labels": self.labels},
               "spec": self.spec}  # fmt: skip
        return yaml.safe_dump_all([*config_maps, pod], sort_keys=False)


@dataclass
class Plan:
    network: str
    namespace: str = ""  # prefixed to every podman object's name (pods, volumes, secrets), never to DNS names
    pods: list[PlayedPod] = field(default_factory=list)
    config_maps: list[Doc] = field(default_factory=list)
    secrets: list[Doc] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def pod(self, name: str) -> PlayedPod:
        """The pod the render calls ``name`` (its podman name has the namespace in front)."""
        (found,) = [p for p in self.pods if p.name == self.namespace + name]
        return found


def render(kustomization: Path) -> list[Doc]:
    done = subprocess.run(
        ["kubectl", "kustomize", str(kustomization)], capture_output=True, text=True, check=True
    )
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _claims_of(spec: Doc) -> list[str]:
    return [
        v["persistentVolumeClaim"]["claimName"]
        for v in spec.get("volumes", [])
        if "persistentVolumeClaim" in v
    ]


def _stateful_pods(workload: Doc, headless: set[str]) -> list[PlayedPod]:
    """A StatefulSet's pods: stable names, hostnames, per-pod claims, and NAME-i.SERVICE as a DNS alias."""
    name, spec = workload["metadata"]["name"], workload["spec"]
    service = spec.get("serviceName", "")
    pods = []
    for i in range(spec.get("replicas", 1)):
        pod_name = f"{name}-{i}"
        pod_spec = copy.deepcopy(spec["template"]["spec"])
        pod_spec["hostname"] = pod_name
        for template in spec.get("volumeClaimTemplates", []):
            volume = template["metadata"]["name"]
            claim = {"name": volume, "persistentVolumeClaim": {"claimName": f"{volume}-{pod_name}"}}
            pod_spec.setdefault("volumes", []).append(claim)
        aliases = [pod_name, *([f"{pod_name}.{service}"] if service in headless else [])]
        pods.append(PlayedPod(pod_name, spec["template"]["metadata"].get("labels", {}), aliases, pod_spec))
    return pods


def _deployment_pods(workload: Doc, replicas: int | None) -> list[PlayedPod]:
    name, spec = workload["metadata"]["name"], workload["spec"]
    count = spec.get("replicas", 1) if replicas is None else replicas
    pods = []
    for i in range(count):
        pod_spec = copy.deepcopy(spec["template"]["spec"])
        pod_spec["hostname"] = f"{name}-{i}"
        pods.append(
            PlayedPod(
                f"{name}-{i}", spec["template"]["metadata"].get("labels", {}), [f"{name}-{i}"], pod_spec
            )
        )
    return pods


def _pod_local(pod: PlayedPod) -> PlayedPod:
    """Per-pod emptyDir names; no host ports (named probe ports resolved to their numbers); OnFailure."""
    pod.spec["restartPolicy"] = "OnFailure"
    renamed = {v["name"]: f"{pod.name}--{v['name']}" for v in pod.spec.get("volumes", []) if "emptyDir" in v}
    for volume in pod.spec.get("volumes", []):
        volume["name"] = renamed.get(volume["name"], volume["name"])
    for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
        numbers = {
            port["name"]: port["containerPort"] for port in container.pop("ports", []) if "name" in port
        }
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            for action in ("httpGet", "tcpSocket"):
                if isinstance(port := container.get(probe, {}).get(action, {}).get("port"), str):
                    container[probe][action]["port"] = numbers[port]
    return pod


def _in_namespace(played: Plan) -> None:
    """Every podman object's name gets the namespace (two plays side by side, e.g. two ``make test`` runs on
    one machine, never share a pod, volume or secret); hostnames and network aliases keep the render's."""
    ns = played.namespace
    for doc in [*played.config_maps, *played.secrets]:
        doc["metadata"]["name"] = ns + doc["metadata"]["name"]
    played.claims = [ns + claim for claim in played.claims]
    for pod in played.pods:
        pod.name = ns + pod.name
        for volume in pod.spec.get("volumes", []):
            for kind, key in (
                ("persistentVolumeClaim", "claimName"),
                ("configMap", "name"),
                ("secret", "secretName"),
            ):
                if kind in volume:
                    volume[kind][key] = ns + volume[kind][key]
        for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            for source in container.get("envFrom", []):
                for ref in source.values():
                    ref["name"] = ns + ref["name"]
            for env in container.get("env", []):
                for kind in ("secretKeyRef", "configMapKeyRef"):
                    if kind in env.get("valueFrom", {}):
                        env["valueFrom"][kind]["name"] = ns + env["valueFrom"][kind]["name"]


def plan(
    docs: list[Doc],
    network: str,
    replicas: dict[str, int] | None = None,
    namespace: str = "",
    images: dict[str, str] | None = None,
) -> Plan:
    """What to create, from the rendered objects; ``replicas`` overrides a Deployment's count (memory);
    ``images`` maps the rendered image names to the IDs just built (scripts/images.py: a tag is shared with
    every other tree on the machine)."""
    played = Plan(network, namespace)
    docs = copy.deepcopy(docs)
    headless = {
        d["metadata"]["name"] for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"
    }
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "ConfigMap":
            played.config_maps.append(doc)
        elif kind == "Secret":
            played.secrets.append(doc)
        elif kind == "PersistentVolumeClaim":
            played.claims.append(name)
        elif kind == "StatefulSet":
            played.pods += _stateful_pods(doc, headless)
        elif kind == "Deployment":
            played.pods += _deployment_pods(doc, (replicas or {}).get(name))
        elif kind in IGNORED:
            played.ignored.append(f"{kind}/{name}")
        else:
            raise ValueError(f"{kind}/{name}: podman kube play here has no way to act on it")
    _in_namespace(played)
    for pod in played.pods:
        for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            container["image"] = (images or {}).get(container["image"], container["image"])
    played.pods = [_pod_local(p) for p in played.pods]
    for p in played.pods:
        played.claims += [c for c in _claims_of(p.spec) if c not in played.claims]
    return played


def memory_dirs(played: Plan, workdir: Path) -> None:
    """Each ``medium: Memory`` emptyDir becomes a fresh host directory of mode 1777 (see the docstring)."""
    for p in played.pods:
        for volume in p.spec.get("volumes", []):
            if volume.get("emptyDir", {}).get("medium") == "Memory":
                path = workdir / "memory" / volume["name"]
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True)
                path.chmod(0o1777)
                del volume["emptyDir"]
                volume["hostPath"] = {"path": str(path.resolve()), "type": "Directory"}


def pod_volumes(played: Plan) -> list[str]:
    """The volumes podman makes for the pods: each emptyDir, and each ConfigMap's files (named after it)."""
    names = []
    for p in played.pods:
        for volume in p.spec.get("volumes", []):
            if "emptyDir" in volume:
                names.append(volume["name"])
            elif "configMap" in volume:
                names.append(volume["configMap"]["name"])
    return list(dict.fromkeys(names))


def podman(*args: str, stdin: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(["podman", *args], env=podman_env(), input=stdin, capture_output=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {done.stdout.decode()}{done.stderr.decode()}")
    return done


def secret_json(secret: Doc) -> bytes:
    """The Secret as podman 4.3's kube play reads a secretKeyRef: a flat JSON map, key to base64 value."""
    data = dict(secret.get("data", {}))
    for key, value in secret.get("stringData", {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    return json.dumps(data).encode()


def seed_volume(claim: str, source: Path, under: str) -> None:
    """Fill volume ``claim`` with ``source``'s files under ``under/`` (e.g. the model at /models/base)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(source, arcname=under, filter=lambda info: _readable(info))
    podman("volume", "import", claim, "-", stdin=buffer.getvalue())


def _readable(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = 0o755 if info.isdir() else 0o644
    return info


def up(played: Plan, workdir: Path, seeds: dict[str, tuple[Path, str]] | None = None) -> None:
    """Create the network, secrets and claims, then play every pod in the render's order (kvgate may start
    before Redis answers: it exits and is restarted, as in a cluster)."""
    down(played, workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    podman("network", "create", played.network)
    for secret in played.secrets:
        podman("secret", "create", secret["metadata"]["name"], "-", stdin=secret_json(secret))
    for claim in played.claims:
        podman("volume", "create", claim)
    memory_dirs(played, workdir)
    for claim, (source, under) in (seeds or {}).items():  # claims by the render's names
        seed_volume(played.namespace + claim, source, under)
    for p in played.pods:
        path = workdir / f"{p.name}.yaml"
        path.write_text(p.manifest(played.config_maps))
        aliases = ",".join(f"alias={a}" for a in p.aliases)
        podman("kube", "play", f"--network={played.network}:{aliases}", str(path))


def down(played: Plan, workdir: Path) -> None:
    """Remove what ``up`` made (missing pieces are fine: a partial ``up``)."""
    for p in played.pods:  # one by one: podman 4.3 refuses the whole list when one pod is missing
        podman("pod", "rm", "-f", "-t", "0", p.name, check=False)
    for volume in [*played.claims, *pod_volumes(played)]:
        podman("volume", "rm", "-f", volume, check=False)
    for secret in played.secrets:
        podman("secret", "rm", secret["metadata"]["name"], check=False)
    podman("network", "rm", "-f", played.network, check=False)
    shutil.rmtree(workdir / "memory", ignore_errors=True)


def pod_ip(played: Plan, name: str) -> str:
    infra = json.loads(podman("pod", "inspect", name).stdout)["InfraContainerID"]
    (container,) = json.loads(podman("container", "inspect", infra).stdout)
    return str(container["NetworkSettings"]["Networks"][played.network]["IPAddress"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "plan"])
    parser.add_argument("kustomization", type=Path)
    parser.add_argument("--network", default="kvgate-pods")
    parser.add_argument("--workdir", type=Path, default=Path(".cache/kube-play"))
    parser.add_argument(
        "--seed", action="append", default=[], help="CLAIM=DIR[:UNDER], e.g. vllm-models=model:base"
    )
    args = parser.parse_args(argv)
    played = plan(render(args.kustomization), args.network)
    if args.action == "plan":
        print("\n".join(f"pod {p.name} (aliases {', '.join(p.aliases)})" for p in played.pods))
        print("not acted on:", ", ".join(played.ignored))
        return 0
    if args.action == "down":
        down(played, args.workdir)
        return 0
    seeds = {}
    for seed in args.seed:
        claim, _, rest = seed.partition("=")
        source, _, under = rest.partition(":")
        seeds[claim] = (Path(source), under or ".")
    up(played, args.workdir, seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
