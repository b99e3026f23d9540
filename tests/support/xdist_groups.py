"""What one pytest-xdist worker runs whole, by where a test lives (``make test`` runs ``-n 3 --dist
loadgroup``; ``tests/conftest.py`` hands xdist this scheduler).

xdist's own ``xdist_group`` mark does nothing with pytest 9 (3.8.0 renames ``item._nodeid``, which pytest 9
no longer reads), so the groups are named here, by path, and the scheduler is xdist's scope scheduler
with this scope: a test in a group goes where its group goes, any other test on its own. The largest
groups are handed out first, one to each worker.
"""

from __future__ import annotations

from typing import Any

import pytest

GROUPS = {
    # the real-vLLM tests: the two replicas start once, in the one worker that runs them all
    "tests/vllm/": "vllm",
    # one podman user at a time: image builds and pods
    "tests/deploy/test_container_image.py": "podman",
    "tests/deploy/test_pods.py": "podman",
    # `pip wheel` of the tree (its build/ directory) one at a time, each module's fixture built once
    "tests/deploy/test_image.py": "wheel",
    "tests/deploy/test_packaging.py": "wheel",
    # every kustomize render, made once by the module fixture
    "tests/deploy/test_deploy.py": "renders",
}


def scope_of(nodeid: str) -> str:
    """The group a test belongs to, else the test itself."""
    return next((group for prefix, group in GROUPS.items() if nodeid.startswith(prefix)), nodeid)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler, its scopes the groups above (``--dist loadgroup`` only; else xdist's own)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only ever called under xdist

    scheduler = LoadScopeScheduling(config, log)
    scheduler._split_scope = scope_of
    return scheduler
