"""A detached controller (``--detach``) at its own job's time limit.

Slurm warns the controller's job with SIGUSR2 ``scheduler.slurm.signal_seconds`` before the
limit (``--signal=B:USR2@N``: the batch shell is the controller itself). With
``scheduler.slurm.requeue=true`` and a training trial that resumes from checkpoints, the
controller then asks the master for a checkpoint (the ``preempt`` key its own workers use on
the same warning), stops every worker and job, and requeues its own job; once Slurm starts that
job again, the launch continues the trial from the checkpoint. A training run started with
``recover=off`` continues with ``recover=resume``: the checkpoints are this run's own. Other
trials' controller jobs get no warning and no requeue: SIGTERM at the limit stops them, with
Slurm's ``KillWait`` to stop their jobs. A requeuing controller whose job is chosen for
preemption sends itself the same SIGUSR2 (:mod:`system.launcher.own_preemption`).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Sequence

from scheduler.slurm_render import job_name
from system import names
from system.errors import NameEntryNotFound
from system.launcher.config import ExperimentConfig, RecoverMode, RunMode
from system.launcher.trial_dir import write_json_atomic
from system.name_resolve import NameResolve
from system.paths import TrialPaths

log = logging.getLogger("controller")

REQUEUE_WAIT = 600.0
"""Seconds the controller waits to be killed by its own requeue before it gives up on it."""


class ControllerRequeue(KeyboardInterrupt):
    """SIGUSR2 to a detached controller that requeues its own job: stop the trial like Ctrl-C,
    after a checkpoint. ``str()`` is the job; ``seconds_left()``, asked once the trial stops
    (not in the signal handler: it may ask Slurm), how long before Slurm ends the job (None:
    unknown, taken as ``scheduler.slurm.signal_seconds``, the time limit's warning)."""

    def __init__(self, job: str,
                 seconds_left: Callable[[], float | None] = lambda: None) -> None:
        super().__init__(job)
        self.seconds_left = seconds_left


def own_job(exp: str, trial: str) -> str | None:
    """This process's Slurm job when it is the trial's detached controller (its job name is
    the controller's), else None."""
    if os.environ.get("SLURM_JOB_NAME") != job_name(exp, trial, "controller"):
        return None
    return os.environ.get("SLURM_JOB_ID") or None


def requeues(cfg: ExperimentConfig) -> bool:
    """Whether the trial's detached controller requeues its own job at the warning (pure):
    Slurm requeues are on and the run is a training run that resumes from checkpoints."""
    return (cfg.scheduler.type.value == "slurm" and cfg.scheduler.slurm.requeue
            and cfg.mode == RunMode.TRAIN and cfg.recovery() is not None)


def requeue_job(cfg: ExperimentConfig) -> str | None:
    """This process's Slurm job when it is the trial's detached controller and requeues that
    job at its warning (:func:`own_job`, :func:`requeues`), else None."""
    job = own_job(cfg.exp, cfg.trial)
    return job if job is not None and requeues(cfg) else None


def restart_count() -> int:
    """How often Slurm has started this job before (``SLURM_RESTART_COUNT``; 0 outside one)."""
    try:
        return max(int(os.environ.get("SLURM_RESTART_COUNT", "0")), 0)
    except ValueError:
        return 0


RECOVER_KEYS = ("recover", "recover.type", "recover.overwrite")


def restart_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides of a requeued controller's launch (pure): ``recover=off`` (with or without
    ``recover.overwrite``) becomes ``recover=resume``, as the checkpoints in the trial are this
    run's own; every other override, ``recover=auto|resume`` included, is kept."""
    off = any(o.partition("=")[0] in ("recover", "recover.type")
              and o.partition("=")[2].strip().lower() == RecoverMode.OFF.value for o in overrides)
    if not off:
        return list(overrides)
    return [o for o in overrides if o.partition("=")[0] not in RECOVER_KEYS] + [
        f"recover={RecoverMode.RESUME.value}"]


def checkpoint_first(nr: NameResolve, exp: str, trial: str, timeout: float,
                     gone: Callable[[], bool] = lambda: False) -> bool:
    """Ask the master for a checkpoint (the ``preempt`` key of ``controller/0``, which it
    deletes once one is committed) and wait up to ``timeout`` seconds for it, or until
    ``gone()`` says the master has ended (preempted with this job, it checkpoints and stops by
    itself, perhaps before it read the request). Returns whether it was committed; never
    raises (the trial stops either way)."""
    key = names.preempt(exp, trial, "controller", 0)
    try:
        nr.add(key, str(time.time()), replace=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                nr.get(key)
            except NameEntryNotFound:
                nr.forget(key)  # answered: not to be added back
                return True
            if gone():
                log.warning("the master ended before it answered the checkpoint request")
                return False
            time.sleep(0.5)
    except Exception as e:  # the name service, say: stop without the checkpoint
        log.warning("could not ask the master for a checkpoint: %s", e)
    return False


def requeue(job_id: str, timeout: float = 60.0) -> str | None:
    """``scontrol requeue <job_id>``: Slurm ends this job (and this process with it) and queues
    it again. Returns the error, or None once asked."""
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit code {r.returncode}")


def wait_for_requeue(job_id: str, seconds: float = REQUEUE_WAIT) -> None:
    """Sleep while Slurm ends this job for its requeue (SIGTERM, then SIGKILL): the stop
    signals are left to their defaults, the trial being stopped already."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    print(f"job {job_id} requeued: the trial continues from its checkpoint when Slurm starts "
          "it again", file=sys.stderr, flush=True)
    time.sleep(seconds)


def end_records(paths: TrialPaths, status: str, why: str) -> None:
    """The requeue is off (refused by Slurm, cancelled meanwhile), or the requeued start ended
    before its controller ran: ``summary.json`` and ``status.json``, which said ``requeued``
    and ``pending``, say ``status``, and ``why`` (logged if they cannot be rewritten)."""
    for path, key in ((paths.summary, "status"), (paths.status, "state")):
        try:
            with open(path) as f:
                record = json.load(f)
            record[key] = status
            record["requeue_note"] = why
            write_json_atomic(path, record)
        except (OSError, ValueError, TypeError) as e:
            log.warning("could not rewrite %s: %s", path, e)


def cancelled_since(paths: TrialPaths, t0: float) -> bool:
    """Whether ``python -m system.ctl cancel`` asked to stop the trial since ``t0`` (epoch
    seconds; its ``cancel.json``): its controller must not requeue itself then."""
    try:
        with open(paths.cancel_request) as f:
            return float(json.load(f).get("time", 0)) >= t0
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def cancelled_while_requeued(paths: TrialPaths) -> bool:
    """Whether ``python -m system.ctl cancel`` asked to stop the trial after the run that
    requeued (or is about to requeue) its controller's job began (its ``summary.json`` says
    ``requeued``): that run must not requeue the job, and a job Slurm started again all the
    same must not continue the trial."""
    try:
        with open(paths.summary) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return False
    return (isinstance(summary, dict) and summary.get("status") == "requeued"
            and cancelled_since(paths, float(summary.get("t0_epoch") or 0.0)))


def stale_pending(paths: TrialPaths) -> bool:
    """Whether ``status.json`` still says ``pending``: written by the run that requeued this
    job, not by this one (whose controller never ran, or never got to write)."""
    try:
        with open(paths.status) as f:
            return json.load(f).get("state") == "pending"
    except (OSError, ValueError, TypeError, AttributeError):
        return False
