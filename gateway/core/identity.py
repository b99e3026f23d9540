"""Who an adapter is: validated artifact manifests (adapter_config.json checked as vLLM reads it), blake3
tree digests and versioned names.

A version's identity is the bytes of its artifact, nothing else: the tree digest covers every file's
relative path, size and contents (sorted, so the order of a directory listing does not matter). The
effective model a request meets is (base model identity, adapter digest); the base identity is
recorded with each version and checked against every replica before it is eligible.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blake3 import blake3

from gateway.core.errors import InvalidAdapter

TREE_DOMAIN = b"kvgate-tree-v1\0"
SHORT_DIGEST_LEN = 16
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_SUFFIX = ".safetensors"
MAX_FILES = 256

# Matched whole (``fullmatch``): ``$`` also matches before a trailing newline, which let ``"id\n"`` through.
_LOGICAL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]+")
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    relpath: str
    size: int


def is_logical_id(name: str) -> bool:
    """Whether ``name`` could be a logical ID: 1-128 of [A-Za-z0-9._-], first a letter or digit."""
    return _LOGICAL_ID.fullmatch(name) is not None


def check_logical_id(logical_id: str) -> str:
    """Logical IDs are plain names: no ``@`` (versioned names use it), no braces (Redis hash tags)."""
    if not is_logical_id(logical_id):
        raise InvalidAdapter(
            f"invalid logical ID {logical_id!r}: use 1-128 of [A-Za-z0-9._-], first a letter or digit",
            param="model",
        )
    return logical_id


def check_digest(digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise InvalidAdapter(f"not a blake3 hex digest: {digest!r}", param="digest")
    return digest


def base_identity(name: str, root: str | None) -> str:
    """A base model's identity: its served name, or ``name=root`` when the root must match too."""
    return name if root is None else f"{name}={root}"


def base_name(identity: str) -> str:
    """The served name in a base identity (``name`` or ``name=root``)."""
    return identity.partition("=")[0]


def versioned_name(logical_id: str, digest: str) -> str:
    """The name a replica loads a version under: ``tenant-42@<first 16 hex of the digest>``."""
    return f"{logical_id}@{digest[:SHORT_DIGEST_LEN]}"


def scan_adapter(root: Path) -> list[ManifestEntry]:
    """Validate a PEFT adapter directory without writing anything; return its sorted manifest.

    Refuses symlinks (the root included), anything that is not a regular file or directory, names
    outside a safe alphabet (no traversal), unreadable files, and directories without an
    ``adapter_config.json`` a replica can load (``check_adapter_config``) and at least one ``*.safetensors``
    weight file.
    """
    try:
        root_stat = os.lstat(root)
    except OSError as exc:
        raise InvalidAdapter(f"adapter directory {str(root)!r} is missing: {exc.strerror}") from exc
    if stat.S_ISLNK(root_stat.st_mode) or not stat.S_ISDIR(root_stat.st_mode):
        raise InvalidAdapter(f"{str(root)!r} is not a plain directory (symlinks are refused)")

    entries: list[ManifestEntry] = []
    _walk(root, "", entries)
    entries.sort(key=lambda e: e.relpath)
    names = {e.relpath for e in entries}
    if ADAPTER_CONFIG not in names:
        raise InvalidAdapter(f"{str(root)!r} has no {ADAPTER_CONFIG}")
    if not any(e.relpath.endswith(WEIGHT_SUFFIX) for e in entries):
        raise InvalidAdapter(f"{str(root)!r} has no *{WEIGHT_SUFFIX} weights")
    try:
        raw = (root / ADAPTER_CONFIG).read_bytes()
    except OSError as exc:
        raise InvalidAdapter(f"cannot read {ADAPTER_CONFIG}: {exc.strerror}") from exc
    check_adapter_config(raw)  # as the replica will read it: UTF-8 JSON, the fields vLLM needs, typed
    return entries


def _walk(root: Path, prefix: str, out: list[ManifestEntry]) -> None:
    try:
        children = sorted(os.scandir(root / prefix) if prefix else os.scandir(root), key=lambda d: d.name)
    except OSError as exc:
        raise InvalidAdapter(f"cannot list {str(root / prefix)!r}: {exc.strerror}") from exc
    for child in children:
        relpath = f"{prefix}/{child.name}" if prefix else child.name
        if not _FILE_NAME.fullmatch(child.name) or child.name in {".", ".."}:
            raise InvalidAdapter(f"refusing file name {relpath!r}")
        mode = child.stat(follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            raise InvalidAdapter(f"refusing symlink {relpath!r}")
        if stat.S_ISDIR(mode):
            _walk(root, relpath, out)
            continue
        if not stat.S_ISREG(mode):
            raise InvalidAdapter(f"refusing non-regular file {relpath!r}")
        if not os.access(child.path, os.R_OK):
            raise InvalidAdapter(f"cannot read {relpath!r}")
        out.append(ManifestEntry(relpath, child.stat(follow_symlinks=False).st_size))
        if len(out) > MAX_FILES:
            raise InvalidAdapter(f"more than {MAX_FILES} files: not an adapter")


def tree_digest(root: Path, manifest: list[ManifestEntry]) -> str:
    """blake3 over (relative path, size, blake3 of contents) for every file, in sorted order.

    File contents are hashed with mmap and blake3's own threads, so large weights stay cheap.
    The recorded size must still match: a file that changed under us fails instead of lying.
    """
    tree = blake3(TREE_DOMAIN)
    for entry in manifest:
        path = root / entry.relpath
        content = blake3(max_threads=blake3.AUTO)
        try:
            if entry.size:
                content.update_mmap(str(path))
            size_now = os.stat(path, follow_symlinks=False).st_size
        except OSError as exc:
            raise InvalidAdapter(f"cannot read {entry.relpath!r}: {exc}") from exc
        if size_now != entry.size:
            raise InvalidAdapter(f"{entry.relpath!r} changed while it was being read")
        name = entry.relpath.encode()
        tree.update(len(name).to_bytes(4, "big") + name + entry.size.to_bytes(8, "big"))
        tree.update(content.digest())
    return tree.hexdigest()


# --- adapter_config.json, as the replica will read it ---------------------------------------------
# vLLM 0.32 reads it with ``json.load(open(path))`` (UTF-8 text) into ``PEFTHelper.from_dict``
# (``vllm/lora/peft_helper.py``): ``r``, ``lora_alpha`` and ``target_modules`` are required, ``r`` (and
# every ``rank_pattern`` rank) a positive integer, and ``validate_legal`` refuses a ``bias`` other than
# ``"none"``, DoRA and LoRA bias. A config that breaks one of these publishes fine and then fails every
# load on every replica, so publish refuses it with the reason (``InvalidAdapter``). What depends on the
# replica's own settings (``max_lora_rank``, the base's module names) cannot be checked here.

_REQUIRED = ("r", "lora_alpha", "target_modules")


def check_adapter_config(raw: bytes) -> dict[str, Any]:
    """The parsed config when a replica could load an adapter with it; else ``InvalidAdapter``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refused(f"is not UTF-8 text (byte {exc.start}; UTF-16 or another encoding?)") from exc
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _refused(f"is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise _refused("is not a JSON object")
    missing = [field for field in _REQUIRED if field not in config]
    if missing:
        raise _refused(f"lacks {', '.join(missing)} (vLLM needs {', '.join(_REQUIRED)} to load a LoRA)")
    if config.get("peft_type", "LORA") != "LORA":
        raise _refused(f"peft_type must be LORA, not {_shown(config['peft_type'])}")
    if not _positive_int(config["r"]):
        raise _refused(f"r must be a positive integer, not {_shown(config['r'])}")
    if not _number(config["lora_alpha"]):
        raise _refused(f"lora_alpha must be a finite number, not {_shown(config['lora_alpha'])}")
    modules = config["target_modules"]
    names = [modules] if isinstance(modules, str) else modules
    if not isinstance(names, list) or not names or not all(isinstance(m, str) and m for m in names):
        raise _refused(f"target_modules must be a module name or a list of them, not {_shown(modules)}")
    _check_patterns(config)
    _check_supported(config)
    return config


def _check_patterns(config: dict[str, Any]) -> None:
    for field, valid, what in (
        ("rank_pattern", _positive_int, "positive integers"),
        ("alpha_pattern", _number, "finite numbers"),
    ):
        pattern = config.get(field)
        if pattern is None:
            continue
        if not isinstance(pattern, dict) or not all(valid(value) for value in pattern.values()):
            raise _refused(f"{field} must map module names to {what}, not {_shown(pattern)}")


def _check_supported(config: dict[str, Any]) -> None:
    """What ``PEFTHelper.validate_legal`` refuses whatever the replica's settings."""
    if config.get("bias", "none") != "none":
        raise _refused(f'bias must be "none" (vLLM supports no adapter bias), not {_shown(config["bias"])}')
    for flag, feature in (("use_dora", "DoRA"), ("lora_bias", "LoRA bias")):
        if config.get(flag) not in (None, False):
            raise _refused(f"{flag} is set: vLLM does not support {feature}")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: object) -> str:
    shown = json.dumps(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _refused(why: str) -> InvalidAdapter:
    return InvalidAdapter(f"{ADAPTER_CONFIG} {why}")
