"""Build another base model for the base-swap test: the fixture's tiny Llama, tokenizer and config, with
weights from another seed (so the same served name and path can hold other weights).

Run with the vLLM virtualenv's python:

    .venv-vllm/bin/python scripts/build_other_base.py --out .cache-base

Writes OUT/model/ (atomically: built in a temporary sibling folder, then renamed into place). It reuses
``build_fixture.py`` (same tokenizer, same architecture) and changes only the seed of the weights; the
shared fixture is never written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import build_fixture as fixture  # scripts/ is on sys.path when this runs as a script
import torch  # type: ignore[import-not-found, unused-ignore]

OTHER_MODEL_SEED = 4321


def build(out: Path) -> Path:
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model_dir = tmp / "model"
        model_dir.mkdir(parents=True)
        tok = fixture.build_tokenizer()
        fixture.save_tokenizer(tok, model_dir)
        fixture.MODEL_SEED = OTHER_MODEL_SEED  # build_model seeds from this module global
        fixture.build_model(tok, model_dir)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="folder to (re)create")
    args = parser.parse_args(argv)
    start = time.monotonic()
    out = build(args.out)
    print(f"other base {out}/model: seed {OTHER_MODEL_SEED}, {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
