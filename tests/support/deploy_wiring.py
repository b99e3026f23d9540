"""Checks of how the rendered objects wire kvgate, vLLM and Redis together, each a list of problems.

A kvgate container is one whose ``args`` start with ``serve``; a vLLM container is one named ``vllm``. A
kvgate setting is read the way the kubelet sets it: ``env`` over ``envFrom`` ConfigMaps (Secret-valued
entries are not read: their value is the operator's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import urlsplit

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from gateway.settings.model import Settings
from gateway.table.connection import CLUSTER, REDIS_PORT, SENTINEL, parse_target, scheme_of
from tests.support.deploy_checks import Obj, _container_ports, named, pods


class ManifestSettings(Settings):
    """kvgate's settings from the given values only: this process's own ``KVGATE_*`` variables stay out."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


FROM_SECRET = object()  # a setting whose value comes from a Secret (not checked here)

Env = dict[str, "str | object"]


def kvgates(objs: list[Obj]) -> Iterator[tuple[str, Obj, Obj, Env]]:
    """(workload name, pod spec, container, its environment) for every kvgate container."""
    maps = named(objs, "ConfigMap")
    for name, _, spec in pods(objs):
        for container in spec["containers"]:
            if container.get("args", [""])[0] == "serve":
                yield name, spec, container, environment(container, maps)


def environment(container: Obj, maps: dict[str, Obj]) -> Env:
    env: Env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps.get(source["configMapRef"]["name"], {}).get("data", {}))
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value", FROM_SECRET)
    return env


def setting_problems(objs: list[Obj]) -> list[str]:
    """Every KVGATE_* variable names a setting, and the plain ones load (types, bounds, cross-checks)."""
    problems = []
    known = {f"KVGATE_{field.upper()}" for field in Settings.model_fields}
    for name, _, container, env in kvgates(objs):
        unknown = sorted(key for key in env if key.startswith("KVGATE_") and key not in known)
        if unknown:
            problems.append(f"{name}/{container['name']}: no such kvgate setting: {', '.join(unknown)}")
        plain = {
            key.removeprefix("KVGATE_").lower(): value
            for key, value in env.items()
            if key.startswith("KVGATE_") and key not in unknown and isinstance(value, str)
        }
        if "replicas" in plain:
            plain["replicas"] = plain["replicas"].split(",")  # type: ignore[assignment]
        try:
            ManifestSettings.model_validate(plain)
        except ValueError as error:
            problems.append(f"{name}/{container['name']}: settings refused: {error}")
    return problems


def _host_problem(objs: list[Obj], pod_spec: Obj, host: str, port: int) -> str | None:
    """None when HOST:PORT reaches something in the render: this pod's own container (localhost), a Service
    (``NAME``), or one pod of a StatefulSet through its headless Service (``STS-N.SERVICE``)."""
    services = named(objs, "Service")
    if host in ("127.0.0.1", "localhost"):
        return None if port in _container_ports(pod_spec) else f"no container of this pod listens on {port}"
    pod_name, _, service_name = host.partition(".")
    if not service_name:
        service = services.get(host)
        if service is None:
            return f"no Service {host}"
        return (
            None
            if port in {p["port"] for p in service["spec"]["ports"]}
            else f"Service {host} has no port {port}"
        )
    service = services.get(service_name)
    if service is None or service["spec"].get("clusterIP") != "None":
        return f"no headless Service {service_name}"
    if port not in {p["port"] for p in service["spec"]["ports"]}:
        return f"Service {service_name} has no port {port}"
    for set_name, workload in named(objs, "StatefulSet").items():
        if workload["spec"]["serviceName"] == service_name and pod_name.startswith(f"{set_name}-"):
            ordinal = pod_name.removeprefix(f"{set_name}-")
            if ordinal.isdigit() and int(ordinal) < workload["spec"].get("replicas", 1):
                return None
            return f"StatefulSet {set_name} has no pod {pod_name}"
    return f"no StatefulSet pod {pod_name} behind {service_name}"


def address_problems(objs: list[Obj]) -> list[str]:
    """kvgate's replica URLs and (in-render) Redis URL name DNS names and ports that exist in the render."""
    problems = []
    for name, spec, container, env in kvgates(objs):
        replicas = env.get("KVGATE_REPLICAS")
        if not isinstance(replicas, str) or not replicas.strip():
            problems.append(f"{name}/{container['name']}: KVGATE_REPLICAS is not set")
            replicas = ""
        addresses: list[tuple[str, str, int]] = []
        for url in filter(None, (part.strip() for part in replicas.split(","))):
            parts = urlsplit(url)
            addresses.append((url, parts.hostname or "", parts.port or 80))
        redis_url = env.get("KVGATE_REDIS_URL")
        if not redis_url:
            problems.append(f"{name}/{container['name']}: KVGATE_REDIS_URL is not set")
        elif isinstance(redis_url, str) and scheme_of(redis_url) in (SENTINEL, CLUSTER):
            addresses += [(redis_url, host, port) for host, port in parse_target(redis_url).nodes]
        elif isinstance(redis_url, str):
            parts = urlsplit(redis_url)
            addresses.append((redis_url, parts.hostname or "", parts.port or REDIS_PORT))
        agents = env.get("KVGATE_REPLICA_AGENTS")
        if isinstance(agents, str) and isinstance(replicas, str):
            wired = ManifestSettings.model_validate(
                {"replicas": replicas.split(","), "replica_agents": agents.split(",")}
            )
            for agent, _ in wired.agent_map.values():
                parts = urlsplit(agent)
                addresses.append((agent, parts.hostname or "", parts.port or 80))
        for url, host, port in addresses:
            problem = _host_problem(objs, spec, host, port)
            if problem:
                problems.append(f"{name}/{container['name']}: {url}: {problem}")
    return problems


def store_problems(objs: list[Obj]) -> list[str]:
    """The store is mounted at KVGATE_STORE, from the same claim, in every kvgate and every vLLM container;
    with an object store, every vLLM container instead shares a pod-local volume with a kvgate agent."""
    stores = {env.get("KVGATE_STORE") for _, _, _, env in kvgates(objs)}
    if any(isinstance(store, str) and store.startswith("s3://") for store in stores):
        return _agent_problems(objs, stores)
    mounts = []
    for name, _, spec in pods(objs):
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", [])
                  if "persistentVolumeClaim" in v}  # fmt: skip
        for container in spec["containers"]:
            if container["name"] == "vllm" or container.get("args", [""])[0] == "serve":
                found = {m["mountPath"]: claims.get(m["name"]) for m in container.get("volumeMounts", [])}
                mounts.append((f"{name}/{container['name']}", found))
    stores = {env.get("KVGATE_STORE") for _, _, _, env in kvgates(objs)}
    if len(stores) != 1 or not isinstance(next(iter(stores)), str):
        return [f"kvgate containers disagree on KVGATE_STORE (or do not set it): {stores}"]
    (store,) = stores
    problems = []
    claim_names = set()
    for where, found in mounts:
        if store not in found:
            problems.append(f"{where}: the store {store} is not mounted there")
        elif found[store] is None:
            problems.append(f"{where}: {store} is not a claim")
        claim_names.add(found.get(store))
    if len(claim_names) > 1:
        problems.append(f"{store} is mounted from different claims: {sorted(map(str, claim_names))}")
    if not any(where.endswith("/vllm") for where, _ in mounts):
        problems.append("no vLLM container in the render")
    return problems


def _agent_problems(objs: list[Obj], stores: set[object]) -> list[str]:
    maps = named(objs, "ConfigMap")
    if len(stores) != 1:
        return [f"kvgate containers disagree on KVGATE_STORE: {stores}"]
    problems = []
    seen_vllm = False
    for name, _, spec in pods(objs):
        by_name = {c["name"]: c for c in spec["containers"]}
        if "vllm" not in by_name:
            continue
        seen_vllm = True
        agent = by_name.get("kvgate-agent")
        if agent is None or agent.get("args", [""])[0] != "agent":
            problems.append(f"{name}: a vLLM pod without a kvgate agent container")
            continue
        env = environment(agent, maps)
        if env.get("KVGATE_STORE") not in stores:
            problems.append(f"{name}/kvgate-agent: KVGATE_STORE is not kvgate's")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        agent_dir = {m["mountPath"]: m["name"] for m in agent.get("volumeMounts", [])}.get(
            env.get("KVGATE_AGENT_DIR")
        )
        vllm_root = {m["mountPath"]: m["name"] for m in by_name["vllm"].get("volumeMounts", [])}.get(
            env.get("KVGATE_AGENT_ROOT")
        )
        if agent_dir is None or agent_dir != vllm_root:
            problems.append(f"{name}: vLLM does not see the agent's KVGATE_AGENT_DIR at KVGATE_AGENT_ROOT")
        elif "emptyDir" not in volumes.get(agent_dir, {}):
            problems.append(f"{name}: the agent's volume {agent_dir} is not pod-local (an emptyDir)")
    if not seen_vllm:
        problems.append("no vLLM container in the render")
    return problems


def claim_problems(objs: list[Obj]) -> list[str]:
    """The store's claim can be mounted by every pod at once, on any node: ReadWriteMany."""
    problems = []
    claims = named(objs, "PersistentVolumeClaim")
    for _, spec, container, env in kvgates(objs):
        store = env.get("KVGATE_STORE")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            claim = volumes.get(mount["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
            shared = claim in claims and "ReadWriteMany" in claims[claim]["spec"]["accessModes"]
            if mount["mountPath"] == store and not shared:
                problems.append(f"PersistentVolumeClaim {claim} (the store) is not ReadWriteMany")
    return problems


def vllm_problems(objs: list[Obj]) -> list[str]:
    """vLLM gets what kvgate relies on; VLLM_SERVER_DEV_MODE exactly where kvgate's invalidation is
    purge-all."""
    invalidations = {env.get("KVGATE_INVALIDATION", "version-scoped") for _, _, _, env in kvgates(objs)}
    problems = (
        [] if len(invalidations) == 1 else [f"kvgates disagree on KVGATE_INVALIDATION: {invalidations}"]
    )
    for name, _, spec in pods(objs):
        for container in spec["containers"]:
            if container["name"] != "vllm":
                continue
            where = f"{name}/vllm"
            args = [*container.get("command", []), *container.get("args", [])]
            flags = {arg.split("=")[0] for arg in args}
            for flag in ("--enable-lora", "--enable-prompt-tokens-details", "--max-loras", "--max-lora-rank"):
                if flag not in flags:
                    problems.append(f"{where}: no {flag}")
            env = {entry["name"]: entry.get("value") for entry in container.get("env", [])}
            if env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") != "True":
                problems.append(f"{where}: VLLM_ALLOW_RUNTIME_LORA_UPDATING is not True")
            purge_all = "purge-all" in invalidations
            if purge_all and env.get("VLLM_SERVER_DEV_MODE") != "1":
                problems.append(f"{where}: purge-all needs VLLM_SERVER_DEV_MODE=1 (/reset_prefix_cache)")
            if not purge_all and "VLLM_SERVER_DEV_MODE" in env:
                problems.append(f"{where}: VLLM_SERVER_DEV_MODE set without purge-all")
            for probe in ("readinessProbe", "livenessProbe"):
                if container.get(probe, {}).get("httpGet", {}).get("path") != "/health":
                    problems.append(f"{where}: {probe} is not on /health")
    return problems


def probe_problems(objs: list[Obj]) -> list[str]:
    """kvgate: ready on /healthz (its port), alive without restarting on /healthz's 503 (draining,
    or no healthy replica); the ServiceMonitor scrapes the listener that serves /metrics (admin_port's)."""
    problems = []
    for name, _, container, env in kvgates(objs):
        where = f"{name}/{container['name']}"
        ports = _container_ports({"containers": [container]})
        ready = container.get("readinessProbe", {}).get("httpGet", {})
        if ready.get("path") != "/healthz" or ports.get(ready.get("port", "")) != int(
            str(env.get("KVGATE_PORT"))
        ):
            problems.append(f"{where}: readinessProbe is not /healthz on KVGATE_PORT")
        alive = container.get("livenessProbe", {})
        command = alive.get("exec", {}).get("command", [])
        if alive.get("httpGet") or command[-3:] != ["-m", "gateway.healthcheck", "--alive"]:
            problems.append(
                f"{where}: livenessProbe would restart a draining kvgate (use gateway.healthcheck --alive)"
            )
        metrics_port = int(str(env.get("KVGATE_ADMIN_PORT") or env.get("KVGATE_PORT")))
        services = named(objs, "Service")
        for monitor in named(objs, "ServiceMonitor").values():
            for endpoint in monitor["spec"]["endpoints"]:
                for service in services.values():
                    wanted = monitor["spec"]["selector"]["matchLabels"].items()
                    if not wanted <= service["metadata"].get("labels", {}).items():
                        continue
                    for port in service["spec"]["ports"]:
                        if (
                            port.get("name") == endpoint["port"]
                            and ports.get(port["targetPort"]) != metrics_port
                        ):
                            problems.append(f"ServiceMonitor scrapes port {port['targetPort']} of {where}, "
                                            f"/metrics is on {metrics_port}")  # fmt: skip
    return problems


def _mounts(spec: Obj, container: Obj) -> dict[str, str | None]:
    """A container's mount paths → the claim each is from (None: not a claim)."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", [])
              if "persistentVolumeClaim" in v}  # fmt: skip
    return {m["mountPath"]: claims.get(m["name"]) for m in container.get("volumeMounts", [])}


def _claim_of(mounts: dict[str, str | None], path: str) -> str | None:
    """The claim ``path`` is read from, by the longest mount path holding it."""
    holding = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return mounts[max(holding, key=len)] if holding else None


def precise_problems(objs: list[Obj]) -> list[str]:
    """Precise routing on in every shape, with no kvgate setting: every vLLM publishes its KV events on a
    declared port kvgate may reach (the NetworkPolicy admits it), no kvgate turns KV events off, and
    every kvgate reads the base's tokenizer at the root vLLM lists (its ``--model`` path, mounted from the
    same claim at the same path), unless it names the tokenizer or the base's directory itself."""
    problems: list[str] = []
    models: set[tuple[str, str | None]] = set()  # (vLLM's --model path, the claim it is read from)
    event_ports: set[str] = set()
    for name, _, spec in pods(objs):
        for container in spec["containers"]:
            if container["name"] != "vllm":
                continue
            args = [*container.get("command", []), *container.get("args", [])]
            model = next((a for a in args[2:] if not a.startswith("-")), "")
            models.add((model, _claim_of(_mounts(spec, container), model)))
            configs = [a.partition("=")[2] for a in args if a.startswith("--kv-events-config=")]
            config = json.loads(configs[0]) if configs else {}
            port = str(config.get("endpoint", "")).rpartition(":")[2]
            named_ports = {str(p["containerPort"]): p.get("name") for p in container.get("ports", [])}
            if config.get("enable_kv_cache_events") is not True or config.get("publisher") != "zmq":
                problems.append(f"{name}/vllm: publishes no KV events (--kv-events-config)")
            elif not str(config["endpoint"]).startswith("tcp://*:") or port not in named_ports:
                problems.append(f"{name}/vllm: its KV event endpoint is no declared tcp://*:PORT")
            else:
                event_ports.add(str(named_ports[port]))
    for policy in named(objs, "NetworkPolicy").values():
        if policy["spec"]["podSelector"].get("matchLabels") != {"kvgate.dev/vllm": "true"}:
            continue
        admitted = {str(p.get("port")) for rule in policy["spec"].get("ingress", []) if rule.get("from")
                    for p in rule.get("ports", [])}  # fmt: skip
        if missing := sorted(event_ports - admitted):
            problems.append(f"NetworkPolicy {policy['metadata']['name']} keeps kvgate from {missing}")
    for name, spec, container, env in kvgates(objs):
        where = f"{name}/{container['name']}"
        if str(env.get("KVGATE_KV_EVENTS", "true")).lower() in ("false", "0", "no", "off"):
            problems.append(f"{where}: KVGATE_KV_EVENTS turns precise routing off")
        if "KVGATE_TOKENIZER" in env or "KVGATE_BASE_MODEL_DIRS" in env:
            continue
        mounts = _mounts(spec, container)
        for model, claim in models:
            if claim is None or _claim_of(mounts, model) != claim:
                problems.append(f"{where}: cannot read the base's tokenizer at {model} (vLLM's --model)")
    return problems
