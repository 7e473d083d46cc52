"""``stacks``: every live worker of a trial, and its controller, writes each of its threads'
Python stacks to its log (:data:`~system.thread_stacks.STACKS_SIGNAL`, SIGURG), and this prints
what they wrote: where a trial that makes no progress is stuck, without stopping it.

- Local workers and warm spares (processes whose command line is one of the trial's) are
  signalled through ``/proc``, those that handle the signal; one still importing is named.
- Slurm jobs the controller last saw running are signalled with ``scancel --signal=URG``
  (their tasks, not their batch scripts). A process that has not set the handler up ignores
  SIGURG: nothing is harmed, whatever runs in the job.
- The controller: a ``--detach`` controller's job with ``scancel --batch`` (the controller is
  its batch script, exec'd; it writes to ``controller.log``), a launcher on this machine
  through ``/proc`` (it writes to its terminal and to ``launcher.log``).

The trial's logs are then read until they have stopped growing (at most :data:`WAIT`
seconds), and what each log that got stacks grew by is printed under its name.
"""
from __future__ import annotations

import glob
import os
import time

from system.ctl import output, procs, slurm_query
from system.ctl.trial_state import TrialView, read_trial
from system.paths import TrialPaths
from system.thread_stacks import SCANCEL_STACKS, STACKS_HEADER, STACKS_SIGNAL, ask_for_stacks

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


def running_jobs(view: TrialView) -> list[str]:
    """The trial's jobs that its record says run, but a ``--detach`` controller's own."""
    controller = view.controller_job()
    return [str(j.get("id")) for j in view.record.get("jobs") or []
            if str(j.get("state")) == "RUNNING" and str(j.get("id")) != controller]


def _signal_slurm(view: TrialView) -> tuple[list[str], list[str]]:
    ids = running_jobs(view)
    if ids and not slurm_query.scancel(ids, SCANCEL_STACKS):
        return [], [f"scancel {SCANCEL_STACKS} {' '.join(ids)} failed"]
    return [f"job {j}" for j in ids], []


def _signal_local(view: TrialView) -> tuple[list[str], list[str]]:
    signalled, skipped = [], []
    for pid in procs.trial_processes(view.paths.root):
        if ask_for_stacks(pid):
            signalled.append(f"pid {pid}")
        elif procs.cmdline(pid) is not None:  # (not one that has just ended)
            skipped.append(f"pid {pid}: still starting (no handler yet)")
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


def _signal_controller(view: TrialView) -> tuple[list[str], list[str]]:
    holder = view.holder
    if holder is None:  # no controller runs
        return [], []
    job = view.controller_job()  # (a --detach controller's: the lock holder's job may be
    if job:  # an allocation a launcher runs in, whose batch script is not the launcher)
        if not slurm_query.scancel([job], "--batch", SCANCEL_STACKS):
            return [], [f"scancel --batch {SCANCEL_STACKS} {job} (the controller's) failed"]
        return [f"the controller's job {job}"], []
    pid = procs.launcher_here(holder, view.exp, view.trial)
    if not pid:
        return [], [f"the controller, pid {holder.get('pid')} on {holder.get('host')!r}: not "
                    "a launcher on this machine"]
    if not ask_for_stacks(pid):
        return [], [f"the controller, pid {pid}: no handler (a launcher from before it had one)"]
    return [f"the controller (pid {pid})"], []


def run(paths: TrialPaths, wait: float = WAIT) -> int:
    """0 once some worker or the controller was signalled, 1 when none could be."""
    view = read_trial(paths)
    before = log_sizes(paths.logs)
    slurm = view.scheduler == "slurm"
    signalled, skipped = _signal_slurm(view) if slurm else _signal_local(view)
    controller = _signal_controller(view)
    signalled, skipped = signalled + controller[0], skipped + controller[1]
    for line in skipped:
        output.say(f"left alone: {line}")
    if not signalled:
        output.say(f"{view.exp}/{view.trial} ({view.state}): no worker or controller to ask for "
                   "its stacks")
        return 1
    output.say(f"{STACKS_SIGNAL.name} to {', '.join(signalled)}: every thread's stack, from the "
               "logs")
    for path, text in grown(before, paths.logs, wait).items():
        if STACKS_HEADER.encode() not in text:  # it only logged meanwhile
            continue
        output.say(f"==> {path}")
        output.say(text.decode(errors="replace").rstrip("\n"))
    return 0
