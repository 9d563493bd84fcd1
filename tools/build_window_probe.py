"""Watches minagi's compiled extension while the tree is rebuilt in place: how often a process
starting then would find it missing or half-written (and so run on the pure-torch ops).

    python tools/build_window_probe.py [--pip] [--rebuilds N]

Runs `setup.py build_ext --inplace` (or `pip install --no-build-isolation --no-deps -e .`) N
times in the repository root while a thread polls the file's size. A size that is neither the
file's size before nor after counts as partial. docs/reliability.md has the figures."""
import argparse
import collections
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pip", action="store_true", help="rebuild through pip install -e . (else setup.py build_ext)")
    p.add_argument("--rebuilds", type=int, default=5)
    a = p.parse_args()
    found = sorted((ROOT / "minagi").glob("_C.*.so"))
    if not found:
        raise SystemExit("build_window_probe: no minagi/_C*.so: build the extension first")
    so = found[0]
    before, sizes, done = so.stat().st_size, collections.Counter(), threading.Event()

    def poll():
        while not done.is_set():
            try:
                sizes[so.stat().st_size] += 1
            except FileNotFoundError:
                sizes[-1] += 1

    cmd = ([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", "."] if a.pip
           else [sys.executable, "setup.py", "build_ext", "--inplace"])
    t = threading.Thread(target=poll)
    t.start()
    try:
        for _ in range(a.rebuilds):
            subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True, env={**os.environ, "MAX_JOBS": "2"})
    finally:
        done.set()
        t.join()
    after = so.stat().st_size
    missing = sizes[-1]
    partial = sum(n for s, n in sizes.items() if s >= 0 and s not in (before, after))
    print(f"{so.name}: {a.rebuilds} rebuilds ({' '.join(cmd[1:])}), {sum(sizes.values()):,} polls: "
          f"{missing:,} missing, {partial:,} partial")
    return 0


if __name__ == "__main__":
    sys.exit(main())
