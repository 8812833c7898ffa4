"""The engine cache's cost on a start: `edgebuild build TARGET --draft DRAFT --cache-dir DIR`
run twice (a miss that builds, then a hit), each in a fresh process.

Reports wall time and bytes read by the process (``rchar`` of /proc/self/io: read() calls,
page cache included; a miss also maps the weights, which rchar does not count, so its figure is
a lower bound). A hit reads the manifest, the entry record, the small files and the sources'
safetensors headers, never the weights.

    python bench/engine_cache.py [--target examples/smollm2-135m-nvfp4]
        [--draft edgebuild/data/smollm2-135m-dspark] [--onnx-only]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = (
    "import atexit, sys\n"
    "def _io():\n"
    "    sys.stderr.write('IO ' + open('/proc/self/io').read().replace(chr(10), ' ') + chr(10))\n"
    "atexit.register(_io)\n"
    "from edgebuild.cli import main\n"
    "main()\n"
)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def run_once(args: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(out.stdout + out.stderr)
    io = next(line for line in out.stderr.splitlines() if line.startswith("IO "))
    rchar = int(io.split("rchar: ")[1].split()[0])
    return wall, rchar, out.stdout.strip().splitlines()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="examples/smollm2-135m-nvfp4")
    p.add_argument("--draft", default="edgebuild/data/smollm2-135m-dspark")
    p.add_argument("--onnx-only", action="store_true", default=True)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        args = ["build", a.target, "--draft", a.draft, "--cache-dir", cache, "--no-progress"]
        args += ["--onnx-only"] if a.onnx_only else []
        size = _tree_bytes(Path(a.target)) + _tree_bytes(Path(a.draft))
        print(f"sources: {size / 1e6:.1f} MB")
        print("| run | wall s | bytes read (rchar) | result |")
        print("|---|---|---|---|")
        wall, rchar, _ = run_once(["cache", "list", "--cache-dir", cache])
        print(f"| baseline: imports + CLI (`cache list`) | {wall:.2f} | {rchar / 1e6:.2f} MB | - |")
        for name in ("miss (builds)", "hit"):
            wall, rchar, line = run_once(args)
            print(f"| {name} | {wall:.2f} | {rchar / 1e6:.2f} MB | {line.split(' (key')[0]} |")


if __name__ == "__main__":
    main()
