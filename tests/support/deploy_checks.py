"""Checks over a rendered set of Kubernetes objects (``kubectl kustomize`` output), each a list of problems.

Used by ``tests/deploy/test_deploy.py`` on every overlay and component combination under ``deploy/``, and on
deliberately broken copies (each check must be able to fail). Offline: the core kinds against the
Kubernetes JSON schemas ``kubernetes-validate`` ships (strict: unknown fields are errors), the
ServiceMonitor against the CRD schema vendored in ``deploy/schemas/``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37 ships (pinned in pyproject)
SCHEMAS = Path(__file__).resolve().parents[2] / "deploy" / "schemas"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
CUSTOM_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json"}

Obj = dict[str, Any]


def named(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {obj["metadata"]["name"]: obj for obj in objs if obj["kind"] == kind}


def pods(objs: list[Obj]) -> Iterator[tuple[str, Obj, Obj]]:
    """(workload name, workload, pod spec) for every pod template."""
    for obj in objs:
        if obj["kind"] in WORKLOADS:
            yield obj["metadata"]["name"], obj, obj["spec"]["template"]["spec"]


def containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _strict(node: Any) -> Any:
    """A CRD schema as the API server's strict field validation reads it: unknown fields refused."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def schema_problems(objs: list[Obj]) -> list[str]:
    problems = []
    for obj in objs:
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        custom = CUSTOM_SCHEMAS.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
        try:
            if custom:
                schema = _strict(json.loads((SCHEMAS / custom).read_text()))
                jsonschema.Draft202012Validator(schema).validate(obj)
            else:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as error:
            problems.append(f"{where}: {getattr(error, 'message', error)}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: no schema for {obj.get('apiVersion')} {obj.get('kind')}")
    return problems


def reference_problems(objs: list[Obj]) -> list[str]:
    """Every ConfigMap, Secret (and key), claim, ServiceAccount and volume a pod names exists."""
    have = {kind: named(objs, kind) for kind in ("ConfigMap", "Secret", "PersistentVolumeClaim")}
    accounts = named(objs, "ServiceAccount")
    problems = []

    def need(kind: str, name: str, where: str, key: str | None = None) -> None:
        found = have[kind].get(name)
        if found is None:
            problems.append(f"{where}: {kind} {name} is not in the render")
        elif key is not None and key not in {**found.get("data", {}), **found.get("stringData", {})}:
            problems.append(f"{where}: {kind} {name} has no key {key}")

    for name, workload, spec in pods(objs):
        account = spec.get("serviceAccountName")
        if account and account not in accounts:
            problems.append(f"{name}: ServiceAccount {account} is not in the render")
        templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {volume["name"] for volume in spec.get("volumes", [])} | templates
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                need("ConfigMap", volume["configMap"]["name"], f"{name} volume {volume['name']}")
            if "secret" in volume:
                need("Secret", volume["secret"]["secretName"], f"{name} volume {volume['name']}")
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                need("PersistentVolumeClaim", claim, f"{name} volume {volume['name']}")
        for container in containers(spec):
            where = f"{name}/{container['name']}"
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    need("ConfigMap", source["configMapRef"]["name"], where)
                if "secretRef" in source:
                    need("Secret", source["secretRef"]["name"], where)
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    need(
                        "Secret",
                        ref["secretKeyRef"]["name"],
                        f"{where} {env['name']}",
                        ref["secretKeyRef"]["key"],
                    )
                if "configMapKeyRef" in ref:
                    key_ref = ref["configMapKeyRef"]
                    need("ConfigMap", key_ref["name"], f"{where} {env['name']}", key_ref["key"])
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{where}: mounts volume {mount['name']}, which the pod does not declare")
    return problems


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def _container_ports(spec: Obj) -> dict[str | int, int]:
    """Each container port by name and by number → its number."""
    ports: dict[str | int, int] = {}
    for container in spec["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def selector_problems(objs: list[Obj]) -> list[str]:
    """Workload, Service, PodDisruptionBudget and ServiceMonitor selectors each match what they must;
    every port a Service targets, a probe checks or a ServiceMonitor scrapes is declared."""
    templates = [
        (name, spec, w["spec"]["template"]["metadata"].get("labels", {})) for name, w, spec in pods(objs)
    ]
    services = named(objs, "Service")
    problems = []
    for name, workload, _ in pods(objs):
        if not _matches(workload["spec"]["selector"]["matchLabels"], templates_of(workload)):
            problems.append(
                f"{workload['kind']} {name}: its selector does not match its pod template's labels"
            )
        service_name = workload["spec"].get("serviceName")
        if service_name is not None:
            service = services.get(service_name)
            if service is None or service["spec"].get("clusterIP") != "None":
                problems.append(f"StatefulSet {name}: serviceName {service_name} is not a headless Service")
    for name, service in services.items():
        selected = [
            (pod, spec) for pod, spec, labels in templates if _matches(service["spec"]["selector"], labels)
        ]
        if not selected:
            problems.append(f"Service {name}: its selector matches no pod template")
        for pod, spec in selected:
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                if target not in _container_ports(spec):
                    problems.append(
                        f"Service {name}: targetPort {target} is not a port of {pod}'s containers"
                    )
    for name, budget in named(objs, "PodDisruptionBudget").items():
        if not any(_matches(budget["spec"]["selector"]["matchLabels"], labels) for _, _, labels in templates):
            problems.append(f"PodDisruptionBudget {name}: its selector matches no pod template")
    every_port = {port for _, spec, _ in templates for port in _container_ports(spec)}
    for name, policy in named(objs, "NetworkPolicy").items():
        if not any(
            _matches(policy["spec"]["podSelector"]["matchLabels"], labels) for _, _, labels in templates
        ):
            problems.append(f"NetworkPolicy {name}: its podSelector matches no pod template")
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                wanted = peer.get("podSelector", {}).get("matchLabels", {})
                if wanted and not any(_matches(wanted, labels) for _, _, labels in templates):
                    problems.append(
                        f"NetworkPolicy {name}: a rule admits pods {wanted}, which no template has"
                    )
            # A named port applies to the selected pods that declare it: it must at least be declared.
            unknown = [port["port"] for port in rule.get("ports", []) if port["port"] not in every_port]
            if unknown:
                problems.append(f"NetworkPolicy {name}: ports {unknown} are declared by no container")
    for name, monitor in named(objs, "ServiceMonitor").items():
        chosen = [
            s for s in services.values() if _matches(monitor["spec"]["selector"]["matchLabels"], labels_of(s))
        ]
        if not chosen:
            problems.append(f"ServiceMonitor {name}: its selector matches no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            for service in chosen:
                service_name = service["metadata"]["name"]
                if endpoint["port"] not in {port.get("name") for port in service["spec"]["ports"]}:
                    problems.append(
                        f"ServiceMonitor {name}: no port {endpoint['port']} on Service {service_name}"
                    )
    for pod, spec, _ in templates:
        for container in spec["containers"]:
            declared = _container_ports({"containers": [container]})
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(kind, {})
                action = probe.get("httpGet") or probe.get("tcpSocket")
                if action and action["port"] not in declared:
                    problems.append(
                        f"{pod}/{container['name']} {kind}: port {action['port']} is not declared"
                    )
    return problems


def templates_of(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def labels_of(obj: Obj) -> dict[str, str]:
    labels: dict[str, str] = obj["metadata"].get("labels", {})
    return labels


def image_problems(objs: list[Obj]) -> list[str]:
    """Every container names a pinned image: a tag other than latest, or a digest."""
    problems = []
    for name, _, spec in pods(objs):
        for container in containers(spec):
            image = container.get("image", "")
            tag = image.rpartition("/")[2].partition(":")[2]
            if "@sha256:" not in image and tag in ("", "latest"):
                problems.append(f"{name}/{container['name']}: image {image!r} is not pinned to a tag")
    return problems


def security_problems(objs: list[Obj]) -> list[str]:
    """Every container: non-root, read-only root filesystem, no privilege escalation, no capabilities."""
    problems = []
    for name, _, spec in pods(objs):
        pod_context = spec.get("securityContext", {})
        for container in containers(spec):
            context = {**pod_context, **container.get("securityContext", {})}
            where = f"{name}/{container['name']}"
            if context.get("runAsNonRoot") is not True or context.get("runAsUser") == 0:
                problems.append(f"{where}: may run as root (runAsNonRoot)")
            if context.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: root filesystem is writable (readOnlyRootFilesystem)")
            if context.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: privilege escalation allowed (allowPrivilegeEscalation)")
            if "ALL" not in context.get("capabilities", {}).get("drop", []):
                problems.append(f"{where}: capabilities not all dropped")
            if context.get("capabilities", {}).get("add"):
                problems.append(f"{where}: adds capabilities")
            if context.get("privileged"):
                problems.append(f"{where}: privileged")
    return problems
