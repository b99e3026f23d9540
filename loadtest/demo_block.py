"""The README's demo block: ``make demo``'s command run, its standard output shown as it comes and
written into the README between the generated-block markers, with the date and the tree
(gateway/dev/generated_docs.py).

It runs what ``make demo``'s recipe runs (``kvgate demo`` with the same data directory), this tree's code;
kvgate's log lines go to stderr and are left out, as the block says. Nothing is written if the demo did not
show the fault and the cure (it exits non-zero then).

Run from the repository root (``make readme-demo``; a few minutes: two vLLM CPU replicas)::

    .venv/bin/python -m loadtest.demo_block --vllm-python .venv-vllm/bin/python \\
        --fixture-dir .cache/fixture [--data-dir .kvgate-demo] [--out README.md]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.dev import generated_docs
from loadtest.proxy_overhead import ROOT, _child_env

NOTE = (
    "*Standard output of `make demo` (kvgate's log lines, on stderr, left out). Ports, paths and the direct "
    "row's max |dlogprob| change from run to run; the digests do not (the fixture is seeded).*"
)


def run_demo(vllm_python: Path, fixture_dir: Path, data_dir: Path) -> tuple[int, str]:
    """``kvgate demo``'s exit code and standard output, the output echoed line by line as it comes."""
    argv = [sys.executable, "-m", "gateway.cli", "demo", "--vllm-python", str(vllm_python),
            "--fixture-dir", str(fixture_dir), "--data-dir", str(data_dir)]  # fmt: skip
    lines: list[str] = []
    with subprocess.Popen(argv, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE, text=True) as demo:
        assert demo.stdout is not None
        for line in demo.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return demo.returncode, "".join(lines)


def block_body(stdout: str) -> str:
    return f"{NOTE}\n\n```\n$ make demo\n{stdout.strip()}\n```"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, required=True, help="python of the vLLM CPU virtualenv")
    parser.add_argument("--fixture-dir", type=Path, required=True, help="tiny model and adapters")
    parser.add_argument("--data-dir", type=Path, default=Path(".kvgate-demo"), help="as `make demo`'s")
    parser.add_argument("--out", default="README.md", help="the doc to write the block into ('-': none)")
    args = parser.parse_args(argv)
    generated_docs.started_tree()  # the tree measured, taken before the run
    code, stdout = run_demo(args.vllm_python.absolute(), args.fixture_dir.absolute(), args.data_dir)
    if code != 0:
        print(f"demo_block: kvgate demo exited {code}; {args.out} left as it was", file=sys.stderr)
        return 1
    if args.out != "-":
        generated_docs.write_block(ROOT / args.out, generated_docs.measured(block_body(stdout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
