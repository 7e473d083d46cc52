"""What a worker's start costs in CPU time, measured side by side in one run.

    .venv/bin/python tests/benchmarks/startup.py             # the tokenizer loads and a trial
    .venv/bin/python tests/benchmarks/startup.py --no-trial  # the loads alone
    .venv/bin/python tests/benchmarks/startup.py --against /tmp/base  # and the trial there
    .venv/bin/python tests/benchmarks/startup.py --trial-only --both --against /tmp/base

On two cores every CPU-second a worker spends importing is a second another worker does not
get: a trial's five workers start at once. Each figure is the median over ``--repeat`` fresh
processes (user + system CPU, and wall time).

Prints ``name: value`` lines:
- tokenizer_<model>_auto_cpu_s, ..._direct_cpu_s, ..._ratio: loading the model's tokenizer with
  ``AutoTokenizer`` (imports torch) against :func:`experiments.rl.tokenizer.load_tokenizer`
  (the class ``AutoTokenizer`` picks, imported directly); ratio = auto / direct
- master_imports_torch_cpu_s, master_imports_cpu_s, master_imports_ratio: what a master loads
  to start beyond its own modules, as it was (``AutoTokenizer``, ``AutoConfig`` for the model
  shape, ``torch.utils.tensorboard``, torch for the advantages) against now (the direct
  tokenizer, the model shape from the model workers, ``tensorboard``'s own event writer, numpy)
- trial_<kind>_cpu_s: CPU time of each worker process of a 4-step arith-tiny trial (sampled
  from ``ps`` twice a second; the largest per kind, a warm spare counted with its kind),
  trial_cpu_s (their sum), trial_all_s (the CPU time of every process of the trial, launcher
  included, from ``getrusage``) and trial_wall_s (launch to exit); the median of ``--trials``
  runs; without warm spares (``scheduler.local.spares=false``), with ``--spares`` with them (the
  default of a trial)
- with ``--against DIR`` (another checkout with its ``.venv`` and ``.models``, e.g. a
  ``git worktree`` of an earlier commit), the same trial there, alternating with this one:
  against_trial_... lines and trial_cpu_ratio, trial_all_ratio, trial_wall_ratio (there / here)
- with ``--both`` (implies ``--spares``), the trial without spares too, alternating with the
  others: no_spares_trial_... lines and no_spares_trial_cpu_ratio, ..._wall_ratio (without /
  with)
- ``--trial-only``: the trial(s) alone
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("arith-tiny", "smollm2-135m-instruct")

AUTO = ("from transformers import AutoTokenizer\n"
        "AutoTokenizer.from_pretrained({path!r}, local_files_only=True)\n")
DIRECT = ("from experiments.rl.tokenizer import load_tokenizer\n"
          "load_tokenizer({path!r})\n")
MASTER_WAS = (AUTO + "from transformers import AutoConfig\n"
              "AutoConfig.from_pretrained({path!r})\n"
              "from torch.utils.tensorboard import SummaryWriter\n"
              "import torch\n")
MASTER_NOW = (DIRECT + "from experiments.rl.tb_events import ScalarWriter\n"
              "import experiments.rl.algorithms.advantages\n")


def _cpu(code: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of a fresh ``python -c code`` in the repository."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime), wall


def side_by_side(name: str, was: str, now: str, repeat: int) -> None:
    runs: dict[str, list[tuple[float, float]]] = {"was": [], "now": []}
    for _ in range(repeat):  # interleaved: a machine that slows down hits both alike
        runs["was"].append(_cpu(was))
        runs["now"].append(_cpu(now))
    cpu = {k: statistics.median(c for c, _ in v) for k, v in runs.items()}
    wall = {k: statistics.median(w for _, w in v) for k, v in runs.items()}
    labels = ("auto", "direct") if name.startswith("tokenizer") else ("torch", "")
    for k, label in zip(("was", "now"), labels):
        key = f"{name}_{label}" if label else name
        print(f"{key}_cpu_s: {cpu[k]:.2f}")
        print(f"{key}_wall_s: {wall[k]:.2f}")
    print(f"{name}_ratio: {cpu['was'] / cpu['now']:.2f}")


def trial(repo: str, spares: bool = False) -> dict[str, float]:
    """One 4-step trial in checkout ``repo`` (``spares``: with the local scheduler's warm
    spares, the default, else without): CPU seconds per worker kind, ``cpu`` (their sum),
    ``all`` (every process of the trial, the launcher and the spares included) and ``wall``
    (launch to exit)."""
    root = tempfile.mkdtemp(prefix="bench-startup-")
    cmd = [os.path.join(repo, ".venv", "bin", "python"), "-m", "system.launch",
           "exp=arith-tiny", "trial=bench", f"cluster.fileroot={root}", "rl.total_steps=4",
           "rl.batch_size=4", "rl.group_size=4", "rl.task.train_size=14", "rl.task.eval_size=8",
           "rl.eval_interval=0", "controller.progress=false",
           f"scheduler.local.spares={str(spares).lower()}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu: dict[int, tuple[str, float]] = {}
    while proc.poll() is None:
        out = subprocess.run(["ps", "-eo", "pid,times,args", "--no-headers"],
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            pid, secs, args = line.split(None, 2)
            if "run_worker" in args and root in args and "--kind" in args:
                cpu[int(pid)] = (args.split("--kind")[1].split()[0], float(secs))
        time.sleep(0.5)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # (each process is reaped by its parent)
    if proc.returncode != 0:
        raise SystemExit(f"the trial in {repo} failed (exit {proc.returncode}); logs: {root}")
    shutil.rmtree(root, ignore_errors=True)
    per_kind: dict[str, float] = {}
    for kind, secs in cpu.values():
        per_kind[kind] = max(per_kind.get(kind, 0.0), secs)
    every = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {**per_kind, "cpu": sum(secs for _, secs in cpu.values()), "all": every,
            "wall": wall}


def trials(runs: dict[str, tuple[str, bool]], n: int) -> dict[str, dict[str, float]]:
    """``n`` trials of each run (label: checkout, with spares), alternating (a machine that
    slows down hits each alike); prints and returns the medians."""
    got: dict[str, list[dict[str, float]]] = {k: [] for k in runs}
    for _ in range(n):
        for label, (repo, spares) in runs.items():
            got[label].append(trial(repo, spares))
    out = {}
    for label, rs in got.items():
        out[label] = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]}
        prefix = f"{label}_trial" if label else "trial"
        for k, v in sorted(out[label].items()):
            print(f"{prefix}_{k}_s: {v:.1f}" if k in ("cpu", "all", "wall")
                  else f"{prefix}_{k}_cpu_s: {v:.0f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-trial", dest="trial", action="store_false")
    p.add_argument("--trials", type=int, default=1, help="trials per checkout (median)")
    p.add_argument("--against", metavar="DIR", help="another checkout to run the trial in too")
    p.add_argument("--spares", action="store_true",
                   help="the trial with warm spares (the local scheduler's default)")
    p.add_argument("--both", action="store_true",
                   help="here, the trial without spares too (no_spares_trial_...)")
    p.add_argument("--trial-only", dest="loads", action="store_false",
                   help="the trial(s) alone, without the tokenizer and import loads")
    args = p.parse_args()
    for model in MODELS if args.loads else ():
        path = os.path.join(REPO, ".models", model)
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            print(f"# {model}: not under .models (make setup)")
            continue
        side_by_side(f"tokenizer_{model.split('-')[0]}", AUTO.format(path=path),
                     DIRECT.format(path=path), args.repeat)
    path = os.path.join(REPO, ".models", MODELS[0])
    if args.loads:
        side_by_side("master_imports", MASTER_WAS.format(path=path),
                     MASTER_NOW.format(path=path), args.repeat)
    if args.trial:
        spares = args.spares or args.both
        runs = {"": (REPO, spares)}
        if args.both:
            runs["no_spares"] = (REPO, False)
        if args.against:
            runs["against"] = (os.path.abspath(args.against), spares)
        out = trials(runs, args.trials)
        for label in runs.keys() - {""}:
            for k in ("cpu", "all", "wall"):
                print(f"{'' if label == 'against' else label + '_'}trial_{k}_ratio: "
                      f"{out[label][k] / out[''][k]:.2f}")


if __name__ == "__main__":
    main()
