"""What a trial directory says about its trial, read from another shell: ``status.json`` (the
controller's live record), ``summary.json`` (the final one), ``cancel.json`` (a cancel request)
and the trial's lock (held by the process that runs the controller).

The state shown is the record's, corrected by what can be checked: a record that says the trial
runs while no process holds the lock is ``lost`` (the controller died without a last word),
an interrupted trial that ``system.ctl cancel`` asked to stop is ``cancelled``.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
from typing import Any

from system.bootstrap import Bootstrap
from system.ctl import slurm_query
from system.launcher.config import RunMode
from system.launcher.status_file import FINAL_STATES, LIVE_STATES, JobRecord, StatusRecord
from system.paths import TrialPaths


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if absent, torn or not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lock_holder(path: str) -> dict[str, Any] | None:
    """The record of the process holding the trial's lock (pid, host, since, slurm_job), or
    None when nobody holds it. A shared lock is tried and dropped at once (a launch at that very
    instant would see the trial as running and refuse: rerun it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        with os.fdopen(fd) as f:
            text = f.read()
        try:
            rec = json.loads(text)
        except ValueError:
            rec = None
        return rec if isinstance(rec, dict) else {"pid": 0, "host": "", "since": ""}
    except OSError:
        os.close(fd)
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


@dataclasses.dataclass(frozen=True)
class TrialView:
    """One trial as its directory shows it."""

    paths: TrialPaths
    exp: str
    trial: str
    state: str
    """pending, starting, running, completed, failed, interrupted, cancelled, lost, unknown."""
    record: StatusRecord
    """``status.json`` (or what ``summary.json`` gives, for a trial from before it existed)."""
    summary: dict[str, Any] | None
    holder: dict[str, Any] | None
    """The lock holder: the live controller's process (None: no controller runs)."""
    cancel: dict[str, Any] | None
    """The cancel request of this run of the trial, if any."""
    other_run: dict[str, Any] | None = None
    """The lock holder when it is the trial's other run: its evaluation (``mode=eval``) while
    this is the training's view, or the reverse."""

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def other_line(self) -> str:
        """What runs of the trial besides this run (empty when nothing does)."""
        if self.other_run is None:
            return ""
        mode = self.other_run.get("mode", RunMode.TRAIN.value)
        what = "its evaluation (mode=eval)" if mode == RunMode.EVAL.value else "its training"
        return (f"{what} runs: pid {self.other_run.get('pid')} on "
                f"{self.other_run.get('host')} (see it with mode={mode})")

    @property
    def scheduler(self) -> str:
        return str(self.record.get("scheduler") or (self.summary or {}).get("scheduler", "?"))

    @property
    def started(self) -> float:
        started = float(self.record.get("started") or 0.0)
        if not started and self.summary:
            started = float(self.summary.get("t0_epoch") or 0.0)
        return started

    def step(self) -> str:
        """The master's step (``3/100``); for a trial that ended while its master was not
        training (stopped during a recovery: its progress says ``phase starting``) the step
        its checkpoint holds, which it resumed from; else its first progress figure, or
        ``-``."""
        progress = self.record.get("progress") or (self.summary or {}).get("progress") or {}
        if "step" in progress:
            return str(progress["step"])
        if not self.live and str(progress.get("resumed_from", "")).isdigit():
            return str(progress["resumed_from"])
        return next((f"{k} {v}" for k, v in progress.items() if v is not None), "-")

    def controller_job(self) -> str:
        return str((self.record.get("controller") or {}).get("slurm_job") or "")


def _from_summary(summary: dict[str, Any]) -> StatusRecord:
    """What a ``summary.json`` of a trial from before ``status.json`` says (jobs per kind)."""
    jobs: list[JobRecord] = [
        {"id": str(j), "workers": [k], "state": "", "detail": "", "restarts": 0, "logs": []}
        for k, ids in (summary.get("jobs") or {}).items() for j in ids]
    return {"exp": str(summary.get("exp", "")), "trial": str(summary.get("trial", "")),
            "scheduler": str(summary.get("scheduler", "")),
            "state": str(summary.get("status", "")),
            "started": float(summary.get("t0_epoch") or 0.0), "jobs": jobs,
            "failure": summary.get("failure"), "progress": {}, "logs": {}}


def run_of(paths: TrialPaths) -> tuple[str, str, str, str]:
    """The exp and trial the run in ``paths.root`` runs as (the names of its keys in name
    resolution), the lock its controller holds and its mode, as its ``bootstrap.json`` says: an
    evaluation (``mode=eval``, in ``<trial>/eval/``) runs as its trial, under the trial's own
    lock. Either runs as the names in its path, not its bootstrap file's (a copy of a trial's
    directory, its ``eval/`` with it, was shown as the original, twice)."""
    exp, trial = os.path.basename(os.path.dirname(paths.root)), os.path.basename(paths.root)
    try:
        boot = Bootstrap.read(paths.bootstrap)
    except (OSError, ValueError, TypeError):
        return exp, trial, paths.lock, RunMode.TRAIN.value
    if boot.mode == RunMode.EVAL.value:
        evaluated = os.path.dirname(paths.root)
        return (os.path.basename(os.path.dirname(evaluated)), os.path.basename(evaluated),
                TrialPaths(evaluated).lock, RunMode.EVAL.value)
    return exp, trial, paths.lock, RunMode.TRAIN.value


def read_trial(paths: TrialPaths) -> TrialView:
    """The trial in ``paths.root`` (or the evaluation run there), its state checked against
    its lock (and, for a detached controller still queued, against ``squeue``)."""
    exp, trial, lock, mode = run_of(paths)
    record: StatusRecord | None = read_json(paths.status)  # type: ignore[assignment]
    summary = read_json(paths.summary)
    if record is None or (summary and float(summary.get("t0_epoch") or 0)
                          > float(record.get("started") or 0) > 0):
        record = _from_summary(summary) if summary else {}
    holder, other = lock_holder(lock), None
    if holder is not None and holder.get("mode", RunMode.TRAIN.value) != mode:
        holder, other = None, holder  # the trial's other run holds it
    cancel = read_json(paths.cancel_request)
    if cancel and record.get("started") and float(cancel.get("time", 0)) < float(
            record.get("started") or 0):
        cancel = None  # a request to an earlier run of this trial
    return TrialView(paths, exp, trial, _state(record, holder, cancel), record, summary,
                     holder, cancel, other)


def _state(record: StatusRecord, holder: dict[str, Any] | None,
           cancel: dict[str, Any] | None) -> str:
    recorded = str(record.get("state") or "")
    if holder is not None:  # a controller runs (maybe a new launch, not yet recorded)
        if recorded in FINAL_STATES or not recorded:
            return "starting"
        return "stopping" if cancel else recorded
    if recorded in FINAL_STATES:
        return "cancelled" if cancel and recorded == "interrupted" else recorded
    if recorded == "pending":  # a detached controller's job, not yet running (or requeued)
        job = str((record.get("controller") or {}).get("slurm_job") or "")
        queued = slurm_query.queue([job]) if job else {}
        if queued and job in queued:  # (a requeued one is COMPLETING, then REQUEUED, first)
            return "starting" if queued[job].state in ("RUNNING", "CONFIGURING") else "pending"
        return "cancelled" if cancel else "lost"
    if recorded in LIVE_STATES:
        return "cancelled" if cancel else "lost"
    return "unknown"


def age(seconds: float) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(max(seconds, 0))}s"


def since(epoch: float) -> str:
    return age(time.time() - epoch) if epoch else "-"
