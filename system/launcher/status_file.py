"""``status.json``: the controller's live record of its trial, for operators and for
``python -m system.ctl``, which reads it from another shell with only the trial directory.

The controller rewrites it atomically (a temporary file renamed over it) at most every
:data:`INTERVAL` seconds while it polls its jobs, and once more when the trial has stopped, with
the final state (``summary.json`` is still written once, at the end, as before). ``--detach``
writes a first record (``pending``) naming the controller's own Slurm job.

The same poll checks, about once a second, whether ``system.ctl cancel`` asked the trial to stop
(the :func:`~system.names.cancel` key): :class:`TrialCancelled` then stops it as Ctrl-C does,
and the trial is recorded as ``cancelled``.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable, Mapping, TypedDict

from scheduler.jobs import JobStatus
from scheduler.slurm_render import job_name
from system import names
from system.errors import NameEntryNotFound
from system.launcher.config import ExperimentConfig
from system.launcher.trial_dir import write_json_atomic
from system.name_resolve import NameResolve
from system.paths import TrialPaths

log = logging.getLogger("controller")

INTERVAL = 2.0
"""Seconds between two writes of ``status.json`` while the trial runs."""
CANCEL_CHECK = 1.0
"""Seconds between two looks at the cancel key."""

LIVE_STATES = ("pending", "starting", "running", "stopping")
"""States of a record whose trial has not stopped (``pending``: a detached controller's job
waits in the queue; ``starting``: jobs submitted, workers registering and configuring;
``stopping``: the controller stops the trial, as ``system.ctl cancel`` asked)."""
FINAL_STATES = ("completed", "failed", "interrupted", "cancelled")


class JobRecord(TypedDict):
    """One job as the controller last saw it (local: one process, its pid as id)."""

    id: str
    workers: list[str]
    state: str
    """A :class:`~scheduler.jobs.JobState` value."""
    detail: str
    restarts: int
    logs: list[str]


class ControllerRecord(TypedDict):
    """Where the controller runs: its pid and host, and its Slurm job with ``--detach``."""

    pid: int
    host: str
    slurm_job: str
    detached: bool


class StatusRecord(TypedDict, total=False):
    """The content of ``status.json``."""

    exp: str
    trial: str
    scheduler: str
    name_resolve: str
    state: str
    """One of :data:`LIVE_STATES` or :data:`FINAL_STATES`."""
    phase: str
    """The last phase reached: submitted, registered, configured, started, completed, stopped."""
    started: float
    """Epoch seconds the controller started (0 while a detached controller is pending)."""
    updated: float
    """Epoch seconds of this write."""
    controller: ControllerRecord
    jobs: list[JobRecord]
    progress: dict[str, Any]
    """The master's latest progress figures (``step``, ``reward``, ...)."""
    logs: dict[str, str]
    """Worker name (``kind/index``) -> its current log file."""
    failure: dict[str, Any] | None
    """``{"message", "worker", "log"}`` of a failed trial."""
    workers: dict[str, int]
    recoveries: list[dict[str, Any]]
    """The automatic recoveries so far (cause, worker, steps; see ``summary.json``)."""


class TrialCancelled(KeyboardInterrupt):
    """``system.ctl cancel`` asked the controller to stop the trial (a KeyboardInterrupt, so
    the controller stops every worker exactly as for Ctrl-C)."""


def job_record(s: JobStatus) -> JobRecord:
    return {"id": s.job_id, "workers": list(s.workers), "state": s.state.value,
            "detail": s.detail, "restarts": s.restarts, "logs": list(s.log_paths)}


def this_controller(exp: str, trial: str) -> ControllerRecord:
    """This process as the trial's controller; ``detached`` when it runs as the trial's own
    controller job (``--detach``), whose job name Slurm puts in ``SLURM_JOB_NAME``."""
    detached = os.environ.get("SLURM_JOB_NAME") == job_name(exp, trial, "controller")
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "slurm_job": os.environ.get("SLURM_JOB_ID", "") if detached else "",
            "detached": detached}


class StatusWriter:
    """Keeps ``status.json`` of one trial up to date from the controller's polls."""

    def __init__(self, cfg: ExperimentConfig, paths: TrialPaths, t0: float,
                 timeline: Mapping[str, float], logs: Mapping[str, str], nr: NameResolve,
                 recoveries: Callable[[], list[dict[str, Any]]] = list,
                 interval: float = INTERVAL) -> None:
        self.path = paths.status
        self.recoveries = recoveries
        self.timeline, self.logs, self.nr = timeline, logs, nr
        self.interval = interval
        self.cancel_key = names.cancel(cfg.exp, cfg.trial)
        self.base: StatusRecord = {
            "exp": cfg.exp, "trial": cfg.trial, "scheduler": cfg.scheduler.type.value,
            "name_resolve": cfg.name_resolve.type.value, "started": t0,
            "controller": this_controller(cfg.exp, cfg.trial), "workers": cfg.worker_counts()}
        self.jobs: list[JobRecord] = []
        self.progress: dict[str, Any] = {}
        self._next_write = 0.0
        self._next_check = 0.0
        self.before_tick: Callable[[], None] = lambda: None
        """Called first by every :meth:`tick` (the launcher's stop signal, redelivered)."""

    def tick(self, statuses: list[JobStatus]) -> None:
        """Called with every poll of the jobs: write the record when due; raise
        :class:`TrialCancelled` once the cancel key is found."""
        self.before_tick()
        self.jobs = [job_record(s) for s in statuses]
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CANCEL_CHECK
            if self._cancel_requested():
                self.write("stopping")  # tells ctl the request was seen
                raise TrialCancelled("cancelled (python -m system.ctl cancel)")
        if now >= self._next_write:
            self.write("running" if "started" in self.timeline else "starting")

    def note_progress(self, progress: Mapping[str, Any]) -> None:
        """The master's latest progress figures (written with the next record)."""
        if progress:
            self.progress = dict(progress)

    def _cancel_requested(self) -> bool:
        try:
            self.nr.get(self.cancel_key)
            return True
        except NameEntryNotFound:
            return False
        except Exception as e:  # a backend hiccup is no cancel request; look again later
            log.warning("could not read the cancel key: %s", e)
            return False

    def write(self, state: str, **extra: Any) -> None:
        """Write the record with ``state`` now (a failed write is logged: the trial goes on)."""
        phase = max(self.timeline, key=lambda k: self.timeline[k], default="")
        record: dict[str, Any] = {**self.base, "state": state, "phase": phase,
                                  "updated": time.time(), "jobs": self.jobs,
                                  "progress": self.progress, "logs": dict(self.logs),
                                  "recoveries": self.recoveries(), **extra}
        try:
            write_json_atomic(self.path, record)
        except OSError as e:
            log.warning("could not write %s: %s", self.path, e)
        self._next_write = time.monotonic() + self.interval

    def final(self, summary: Mapping[str, Any], poll: Callable[[], list[JobStatus]]) -> None:
        """The last record: the summary's status (``pending`` for ``requeued``) and failure, and
        the jobs as they ended."""
        try:
            self.jobs = [job_record(s) for s in poll()]
        except Exception as e:  # the scheduler may not answer any more: keep the last seen
            log.warning("could not poll the jobs for the final status: %s", e)
        status = str(summary.get("status", "failed"))
        # a requeued controller's job is queued again: the trial is pending, as after --detach
        self.write("pending" if status == "requeued" else status, failure=summary.get("failure"))


def write_pending(cfg: ExperimentConfig, paths: TrialPaths, job_id: str, since: float) -> None:
    """``--detach``: the controller is Slurm job ``job_id``, still queued. Nothing is written if
    the controller already wrote a record of its own (it may start before this runs)."""
    try:
        if os.path.getmtime(paths.status) >= since:
            return
    except OSError:
        pass
    record: StatusRecord = {
        "exp": cfg.exp, "trial": cfg.trial, "scheduler": cfg.scheduler.type.value,
        "name_resolve": cfg.name_resolve.type.value, "state": "pending", "phase": "",
        "started": 0.0, "updated": time.time(), "workers": cfg.worker_counts(), "jobs": [],
        "progress": {}, "logs": {},
        "controller": {"pid": 0, "host": "", "slurm_job": job_id, "detached": True}}
    write_json_atomic(paths.status, record)
