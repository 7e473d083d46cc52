"""Chaos benchmark: the default experiment with a schedule of SIGKILLs, against an uninterrupted
run of the same experiment, measured in one run.

    .venv/bin/python tests/benchmarks/chaos.py                     # or: make bench
    .venv/bin/python tests/benchmarks/chaos.py --steps 40 --kills rollout:8,generation:16,model:24,master:32

The default is the default run (arith-tiny's 160 steps) with one kill of each kind.

Prints ``name: value`` lines:
- recovered: 1 when the run with kills completed (exit 0) at the same step count
- steps_lost: steps trained again after the recoveries (from summary.json's ``recoveries``)
- duplicated_prompts / skipped_prompts: prompts trained twice within an epoch / prompts of a
  completed epoch never trained (from ``prompts_per_step``)
- detect_s: mean seconds from a kill to the controller's detection
- recover_s: mean seconds from detection to the next trained step (and per killed kind)
- goodput: loop time of the uninterrupted run / loop time of the run with kills (first to last
  trained step, wall clock)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pids(root: str, kind: str) -> list[int]:
    """Live worker processes of ``kind`` of the trial in ``root``, by process name (``kind/i``;
    a warm spare is ``spare/kind`` until a restart takes it over)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if root in cmd and "run_worker" in cmd and name.split("/")[0] == kind:
            out.append(int(entry))
    return out


def _steps(root: str) -> dict[int, float]:
    """Trained steps seen so far, with the time each was first seen."""
    path = os.path.join(root, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    out = {}
    with open(path) as f:
        for line in f:
            try:
                out[int(json.loads(line)["step"])] = 0.0
            except (ValueError, KeyError):
                continue
    return out


def run(fileroot: str, trial: str, steps: int, prompts: int, kills: list[tuple[str, int]]
        ) -> dict:
    """One trial; kill a worker of each scheduled kind once the step is reached. Returns the
    summary, wall times of steps, and the kill times."""
    root = os.path.join(fileroot, "arith-tiny", trial)
    proc = subprocess.Popen([sys.executable, "-m", "system.launch", "exp=arith-tiny",
                             f"trial={trial}", f"cluster.fileroot={fileroot}",
                             f"rl.total_steps={steps}", "rl.eval_interval=0",
                             f"rl.task.train_size={prompts}",
                             f"recover.retries={max(3, len(kills))}",
                             "controller.progress=false"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    seen: dict[int, float] = {}
    killed: list[tuple[str, int, float]] = []
    todo = sorted(kills, key=lambda k: k[1])
    while proc.poll() is None:
        now = time.time()
        for s in _steps(root):
            seen.setdefault(s, now)
        if todo and seen and max(seen) >= todo[0][1]:
            kind, step = todo[0]
            pids = _pids(root, kind)
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append((kind, step, time.time()))
                todo.pop(0)
        time.sleep(0.2)
    err = proc.stderr.read() if proc.stderr else ""
    with open(os.path.join(root, "summary.json")) as f:
        summary = json.load(f)
    if proc.returncode != 0:
        print(err[-3000:], file=sys.stderr)
    return {"summary": summary, "seen": seen, "killed": killed, "code": proc.returncode}


def prompt_counts(history: list, prompts: int) -> tuple[int, int]:
    """(prompts trained twice within an epoch, prompts of a completed epoch never trained)."""
    per_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for step in history:
        for pid, epoch in step:
            per_epoch[epoch].append(pid)
    dup = sum(len(p) - len(set(p)) for p in per_epoch.values())
    last = max(per_epoch) if per_epoch else 0
    skipped = sum(prompts - len(set(p)) for e, p in per_epoch.items() if e < last)
    return dup, skipped


def slowest_gaps(seen: dict[int, float], n: int = 12) -> list[tuple[int, float]]:
    """The ``n`` longest waits between consecutive trained steps: (step reached, seconds)."""
    steps = sorted(s for s in seen if s >= 1)
    gaps = [(b, seen[b] - seen[a]) for a, b in zip(steps, steps[1:])]
    return sorted(gaps, key=lambda g: -g[1])[:n]


def loop_seconds(seen: dict[int, float]) -> float:
    trained = {s: t for s, t in seen.items() if s >= 1}
    return max(trained.values()) - min(trained.values()) if len(trained) > 1 else float("nan")


KINDS = ("master", "model", "generation", "rollout")
"""The kinds a kill may name (the workers of the arith-tiny layout)."""


def parse_kills(p: argparse.ArgumentParser, text: str, steps: int) -> list[tuple[str, int]]:
    """``--kills`` as ``[(kind, step)]``; anything else is a usage error (exit 2) naming it:
    an unknown kind or a step the run never trains killed nothing, and the run reported
    ``recoveries: 0`` as if it had."""
    kills = []
    for item in filter(None, text.split(",")):
        kind, _, step = item.partition(":")
        if kind not in KINDS or not step.isdigit() or not 1 <= int(step) < steps:
            p.error(f"--kills: {item!r} is not KIND:STEP with KIND one of {', '.join(KINDS)} "
                    f"and STEP from 1 to {steps - 1} (--steps {steps})")
        kills.append((kind, int(step)))
    return kills


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--kills", default="rollout:30,generation:60,model:90,master:120",
                   help="KIND:STEP,... (one SIGKILL each once the step was trained)")
    p.add_argument("--prompts", type=int, default=256,
                   help="rl.task.train_size (small enough that epochs complete)")
    p.add_argument("--keep", default="",
                   help="keep both trials under this directory (default: a temporary one)")
    p.add_argument("--gaps", action="store_true",
                   help="also print the slowest step gaps of each run (where the time went)")
    a = p.parse_args()
    kills = parse_kills(p, a.kills, a.steps)
    with tempfile.TemporaryDirectory() as tmp:
        fileroot = a.keep or tmp
        base = run(fileroot, "uninterrupted", a.steps, a.prompts, [])
        chaos = run(fileroot, "chaos", a.steps, a.prompts, kills)
    if a.gaps:
        for name, r in (("uninterrupted", base), ("chaos", chaos)):
            print(f"gaps_{name}: " + " ".join(f"{s}:{g:.1f}" for s, g in slowest_gaps(r["seen"])))
        t0 = min(chaos["seen"].values())
        print("kills_at_s: " + " ".join(f"{k}@{t - t0:.1f}" for k, _, t in chaos["killed"]))
    s = chaos["summary"]
    rec = s.get("recoveries", [])
    t0 = s.get("t0_epoch", 0.0)
    detect = [t0 + r["failed_at_s"] - k[2] for r, k in zip(rec, chaos["killed"])]
    recover, by_kind = [], []
    for r in rec:
        failed = t0 + r["failed_at_s"]
        after = [t for t in chaos["seen"].values() if t > failed]
        if after:
            recover.append(min(after) - failed)
            by_kind.append(f"{(r.get('worker') or '?').split('/')[0]}={min(after) - failed:.1f}")
    history = (s.get("results") or {}).get("prompts_per_step", [])
    dup, skipped = prompt_counts(history, a.prompts)
    print(f"layout: arith-tiny, {a.steps} steps, kills {a.kills}")
    print(f"recovered: {int(chaos['code'] == 0 and s.get('steps') == a.steps)}")
    print(f"recoveries: {len(rec)}")
    print(f"steps_lost: {sum(r.get('steps_lost') or 0 for r in rec)}")
    print(f"duplicated_prompts: {dup}")
    print(f"skipped_prompts: {skipped}")
    print(f"detect_s: {sum(detect) / len(detect):.1f}" if detect else "detect_s: nan")
    print(f"recover_s: {sum(recover) / len(recover):.1f}" if recover else "recover_s: nan")
    print(f"recover_s_by_kind: {' '.join(by_kind)}")
    print(f"loop_s_uninterrupted: {loop_seconds(base['seen']):.1f}")
    print(f"loop_s_with_kills: {loop_seconds(chaos['seen']):.1f}")
    print(f"goodput: {loop_seconds(base['seen']) / loop_seconds(chaos['seen']):.2f}")
    return 0 if chaos["code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
