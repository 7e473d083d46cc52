"""How rank processes start: forked from a server that imported torch once, against spawned,
each importing it again. Runs ``python -m system.reshard check`` (a whole bit-exact reshard, one
process per rank over gloo) with ``--start-method forkserver`` and ``--start-method spawn``,
alternated, each in a fresh process, and prints the wall and CPU seconds of each (the command and
every process it started: this process is their subreaper, so the fork server, which outlives
the command by a moment, is reaped and counted too) and their ratios.

    .venv/bin/python tests/benchmarks/rank_start.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = {
    "fsdp dp=2,tp=2 -> tp=2 x2 (8 ranks)": ["--src", "dp=2,tp=2,pp=1", "--dst",
                                            "tp=2,replicas=2"],
    "megatron dp=2,tp=2,pp=2 -> tp=2 x2 (12 ranks)": ["--src-backend", "megatron", "--src",
                                                      "dp=2,tp=2,pp=2", "--dst",
                                                      "tp=2,replicas=2", "--model", "small"],
}


_PR_SET_CHILD_SUBREAPER = 36


def _reap_orphans(timeout: float = 30.0) -> None:
    """Wait for every descendant left to this subreaper (the fork server ends once the command
    that started it has)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
    raise SystemExit("a process of the check outlived it by 30 s")


def _once(args: list[str], method: str) -> tuple[float, float]:
    """Wall seconds of one check, and the CPU seconds of every process of it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "system.reshard", "check", *args,
                        "--start-method", method], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    wall = time.perf_counter() - t0
    _reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0 or not r.stdout.startswith("ok:"):
        raise SystemExit(f"check failed ({method}):\n{r.stdout}{r.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    opts = p.parse_args()
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("cannot become a subreaper: the fork server's CPU would go uncounted")
    print(f"rank_start: {os.cpu_count()} CPUs, {opts.rounds} rounds, methods alternated")
    for name, args in CASES.items():
        got: dict[str, list[tuple[float, float]]] = {"forkserver": [], "spawn": []}
        for i in range(opts.rounds):
            order = ("forkserver", "spawn") if i % 2 == 0 else ("spawn", "forkserver")
            for method in order:
                got[method].append(_once(args, method))
        med = {m: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
               for m, runs in got.items()}
        print(f"{name}:")
        for m, (wall, cpu) in med.items():
            print(f"  {m:10s} wall {wall:5.1f} s  cpu {cpu:5.1f} s  (median of {opts.rounds})")
        print(f"  wall_ratio {med['spawn'][0] / med['forkserver'][0]:.2f}  "
              f"cpu_ratio {med['spawn'][1] / med['forkserver'][1]:.2f}  (spawn / forkserver)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
