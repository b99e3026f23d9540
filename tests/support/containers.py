"""podman for the image and pod tests (tests/deploy/test_container_image.py, tests/deploy/test_pods.py):
containers run
as the manifests run them, health checks run on demand, everything removed on the way out.

podman needs ``deploy/image/containers.conf`` here (scripts/images.py passes it); without systemd it runs a
container's health check only when asked (``podman healthcheck run``), never on a timer.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scripts.images import podman_env

KVGATE_UID = 10001  # the image's user, and the manifests' runAsUser / fsGroup
# How the manifests run every container (securityContext: readOnlyRootFilesystem, capabilities drop ALL,
# allowPrivilegeEscalation false). podman's --read-only would add tmpfs on /tmp, /run and /var/tmp: the
# manifests give only what they mount (an emptyDir on /tmp), so that is turned off.
RESTRICTED = ("--read-only", "--read-only-tmpfs=false", "--cap-drop=ALL", "--security-opt=no-new-privileges")


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return done


def inspect(kind: str, name: str) -> Any:
    found = json.loads(podman(kind, "inspect", name).stdout)
    if isinstance(found, list):  # podman 4.3: a list for containers and images, one object for a pod
        (found,) = found
    return found


def logs(name: str) -> str:
    done = podman("logs", name, check=False)
    return (done.stdout + done.stderr)[-4000:]


def health(name: str) -> int:
    """Run the container's HEALTHCHECK now: 0 healthy, 1 unhealthy (podman's exit codes)."""
    return podman("healthcheck", "run", name, timeout=60, check=False).returncode


def owned_dir(path: Path, uid: int = KVGATE_UID) -> Path:
    """A host directory the image's user owns (what fsGroup gives a volume in Kubernetes)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    return path


class Pod:
    """A podman pod (one network namespace, like a Kubernetes pod) and the containers run in it."""

    def __init__(self, prefix: str) -> None:
        self.name = f"{prefix}-{secrets.token_hex(3)}"
        self.containers: list[str] = []

    def run(self, name: str, image: str, *args: str, options: tuple[str, ...] = ()) -> str:
        """Start a container in this pod (detached); its full name."""
        full = f"{self.name}-{name}"
        podman("run", "-d", "--pod", self.name, "--name", full, *options, image, *args)
        self.containers.append(full)
        return full

    @property
    def ip(self) -> str:
        infra = inspect("pod", self.name)["InfraContainerID"]
        networks = inspect("container", infra)["NetworkSettings"]["Networks"]
        return str(next(iter(networks.values()))["IPAddress"])

    def logs(self) -> str:
        return "\n".join(f"--- {name}:\n{logs(name)}" for name in self.containers)


@contextmanager
def pod(prefix: str) -> Iterator[Pod]:
    made = Pod(prefix)
    podman("pod", "create", "--name", made.name)
    try:
        yield made
    finally:
        podman("pod", "rm", "-f", "-t", "0", made.name, check=False)
