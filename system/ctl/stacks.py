"""``stacks``: every live worker of a trial writes each of its threads' Python stacks to its
log (:data:`~system.thread_stacks.STACKS_SIGNAL`, SIGQUIT), and this prints what they wrote:
where a trial that makes no progress is stuck, without stopping it.

- Local workers and warm spares are signalled through ``/proc``: only processes whose command
  line is one of the trial's and that already handle the signal (one still importing would
  die of it).
- A Slurm job is signalled with ``scancel --signal=QUIT`` (its tasks, not its batch script),
  once every worker it runs has a live heartbeat, so each task has set its handler up. A job
  whose workers are still starting is named and left alone.

The trial's logs are then read until they have stopped growing (at most :data:`WAIT`
seconds), and what each log that got stacks grew by is printed under its name.
"""
from __future__ import annotations

import glob
import os
import time

from system.ctl import output, procs, slurm_query
from system.ctl.live import read_live
from system.ctl.trial_state import TrialView, read_trial
from system.paths import TrialPaths
from system.thread_stacks import STACKS_SIGNAL

WAIT = 5.0
"""Seconds at most that the logs are watched for the stacks (a Slurm node's shared file system
may show what a task wrote a little later)."""
SETTLED = 0.5
"""Seconds without growth after which the logs are read as complete."""


def log_sizes(logs_dir: str) -> dict[str, int]:
    """The size of each ``*.log`` in ``logs_dir``."""
    sizes = {}
    for path in glob.glob(os.path.join(glob.escape(logs_dir), "*.log")):
        try:
            sizes[path] = os.path.getsize(path)
        except OSError:
            pass
    return sizes


def slurm_ready(jobs: list[dict], beating: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Of the recorded ``jobs``, the ids of the running ones whose workers all beat, and a line
    for each running one that is left alone (pure)."""
    ready, skipped = [], []
    for job in jobs:
        if str(job.get("state")) != "RUNNING":
            continue
        missing = [w for w in job.get("workers") or [] if w not in beating]
        if missing:
            skipped.append(f"job {job.get('id')}: {', '.join(missing)} not started yet")
        else:
            ready.append(str(job.get("id")))
    return ready, skipped


def _signal_slurm(view: TrialView) -> tuple[list[str], list[str]]:
    live = read_live(view.paths, view.exp, view.trial)
    if live.problem:
        return [], [live.problem]
    controller = view.controller_job()  # (a --detach controller's job: no worker in it)
    jobs = [j for j in view.record.get("jobs") or [] if str(j.get("id")) != controller]
    ready, skipped = slurm_ready(list(jobs), live.heartbeats)
    if ready and not slurm_query.scancel(ready, f"--signal={STACKS_SIGNAL.name[3:]}"):
        return [], skipped + [f"scancel --signal=QUIT {' '.join(ready)} failed"]
    return [f"job {j}" for j in ready], skipped


def _signal_local(view: TrialView) -> tuple[list[str], list[str]]:
    signalled, skipped = [], []
    for pid in procs.trial_processes(view.paths.root):
        if not procs.catches(pid, STACKS_SIGNAL):
            skipped.append(f"pid {pid}: still starting (no handler yet)")
            continue
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        signalled.append(f"pid {pid}")
    return signalled, skipped


def grown(before: dict[str, int], logs_dir: str, wait: float = WAIT) -> dict[str, bytes]:
    """What each log in ``logs_dir`` gained since ``before`` (its sizes then), read once no log
    has grown for :data:`SETTLED` seconds or after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    last, still = log_sizes(logs_dir), time.monotonic()
    while time.monotonic() < deadline and (last == before or time.monotonic() - still < SETTLED):
        time.sleep(0.1)
        now = log_sizes(logs_dir)
        if now != last:
            last, still = now, time.monotonic()
    out = {}
    for path, size in sorted(last.items()):
        start = before.get(path, 0)
        if size > start:
            with open(path, "rb") as f:
                f.seek(start)
                out[path] = f.read(size - start)
    return out


def run(paths: TrialPaths, wait: float = WAIT) -> int:
    """0 once some worker was signalled, 1 when none could be."""
    view = read_trial(paths)
    before = log_sizes(paths.logs)
    slurm = view.scheduler == "slurm"
    signalled, skipped = _signal_slurm(view) if slurm else _signal_local(view)
    for line in skipped:
        output.say(f"left alone: {line}")
    if not signalled:
        output.say(f"{view.exp}/{view.trial} ({view.state}): no worker to ask for its stacks")
        return 1
    output.say(f"SIGQUIT to {', '.join(signalled)}: every thread's stack, from the logs")
    for path, text in grown(before, paths.logs, wait).items():
        if b"(most recent call first)" not in text:  # it only logged meanwhile
            continue
        output.say(f"==> {path}")
        output.say(text.decode(errors="replace").rstrip("\n"))
    return 0
