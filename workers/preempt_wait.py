"""How long a warned worker has before Slurm ends its job, and the wait of one that holds training
state for the master's checkpoint within it.

Slurm's warning comes ``scheduler.slurm.signal_seconds`` before a time limit (SIGUSR2), and a
preemption with a ``GraceTime`` ends the job when the grace does (SIGTERM, read as SIGUSR2 by
:meth:`~workers.base.Worker._on_signal`). A fixed wait fitted neither: 90 s outlived a 30 s
grace (the job was killed mid-wait, its requeue never asked for), and gave up on a checkpoint
that a warning of 600 s, set for a model whose checkpoint takes minutes, had room for (the steps
since the last checkpoint were lost). So the wait is what Slurm really leaves (``scontrol``: the
job's ``EndTime``, or its preemption's grace), less a reserve for the stop and the requeue that
follow; capped where no end is near (a SIGUSR2 sent by hand).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, ClassVar, Protocol

from system import names
from system.bootstrap import Bootstrap
from system.name_resolve_api import NameEntryNotFound

log = logging.getLogger("worker")


class Warned(Protocol):
    """What of a :class:`~workers.base.Worker` the wait uses."""

    exp: str
    trial: str
    kind: ClassVar[str]
    index: int
    boot: Bootstrap
    name_resolve: Any
    started_at: float
    stop_by: float | None

    @property
    def name(self) -> str: ...

    @property
    def stopping(self) -> bool: ...

    def wait_stop(self, timeout: float | None = None) -> bool: ...

    def stop(self) -> None: ...


PREEMPT_WAIT = 90.0
"""Seconds a warned worker waits for the checkpoint where nothing says when its job ends (the
local scheduler, a SIGUSR2 sent by hand): as long as Slurm's default 120 s warning allows."""

STOP_RESERVE = 30.0
"""Seconds kept, of what is left before Slurm ends the job, for the worker's stop, its srun's end
and the batch script's requeue (half of what is left, when that is under twice this)."""

LOOK_TIMEOUT = 3.0
"""Seconds the look at the job (``scontrol``) may take; no answer: the warning's length."""


def checkpoint_wait(left: float | None, warning: float) -> float:
    """Seconds to wait for the checkpoint, with ``left`` seconds before Slurm ends the job
    (None: unknown, taken as the warning's length) and a time-limit warning of ``warning``
    seconds (0: none) (pure). What is left less its :func:`reserve`; at most what the warning
    itself leaves that way, or :data:`PREEMPT_WAIT` if more (a SIGUSR2 with no end near, sent
    by hand); :data:`PREEMPT_WAIT` where nothing says when the job ends."""
    if left is None:
        if not warning:
            return PREEMPT_WAIT
        left = warning
    cap = max(PREEMPT_WAIT, warning - reserve(warning))
    return max(min(left - reserve(left), cap), 0.0)


def reserve(left: float) -> float:
    """Seconds kept of ``left`` for the stop and the requeue: :data:`STOP_RESERVE`, or half of
    ``left`` when that is less (pure)."""
    return min(STOP_RESERVE, left / 2)


def seconds_left(since: float) -> float | None:
    """Before Slurm ends this process's job (its ``EndTime``, or a preemption's grace chosen
    after ``since``, epoch seconds); None outside Slurm, for a job with no end, or when
    ``scontrol`` does not answer within :data:`LOOK_TIMEOUT`."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    from scheduler import slurm_preempt  # (Slurm's commands: under Slurm only)

    try:
        job, found = slurm_preempt.look(job_id, since, LOOK_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - unknown: the warning's length is taken
        log.warning("could not ask Slurm when job %s ends: %s", job_id, e)
        return None
    return slurm_preempt.seconds_left(job, found, time.time())


def stop_deadline(worker: Warned) -> tuple[float, float | None]:
    """(the monotonic time by which a warned ``worker`` stops, seconds left before its job
    ends or None), looked up now."""
    left = seconds_left(worker.started_at)
    return time.monotonic() + checkpoint_wait(left, worker.boot.preempt_warning), left


_TIGHTEN = threading.Lock()


def tighten(worker: Warned, by: float) -> None:
    """``worker.stop_by`` no later than ``by`` (a later signal never pushes it further out)."""
    with _TIGHTEN:
        worker.stop_by = by if worker.stop_by is None else min(worker.stop_by, by)


def cut_in_flight(worker: Warned) -> None:
    """A warned ``worker`` that holds no state to checkpoint but has work in flight: its
    :attr:`stop_by` at once by the warning's length, then (a thread: ``scontrol`` may take
    seconds, and the stop does not wait for it) by what Slurm really leaves the job."""
    tighten(worker, time.monotonic() + checkpoint_wait(None, worker.boot.preempt_warning))
    threading.Thread(target=lambda: tighten(worker, stop_deadline(worker)[0]),
                     name="preempt-look", daemon=True).start()


def stop_after_checkpoint(worker: Warned, timeout: float | None = None) -> None:
    """Ask the master for a checkpoint (``worker``'s ``preempt`` key, which the master deletes
    once one is committed) and stop ``worker`` once it is, or after ``timeout`` seconds (None:
    :func:`checkpoint_wait` of what Slurm leaves), from a daemon thread."""
    key = names.preempt(worker.exp, worker.trial, worker.kind, worker.index)
    t0 = time.monotonic()

    def wait() -> None:
        try:
            worker.name_resolve.add(key, str(time.time()), replace=True)
            if timeout is None:
                deadline, left = stop_deadline(worker)
                ends = "" if left is None else f"; Slurm ends its job in {left:.0f}s"
            else:
                deadline, ends = t0 + timeout, ""
            tighten(worker, deadline)
            log.warning("%s waits up to %.0fs for the trial's checkpoint%s", worker.name,
                        deadline - t0, ends)
            while time.monotonic() < deadline and not worker.wait_stop(
                    min(0.5, max(deadline - time.monotonic(), 0.0))):
                try:
                    worker.name_resolve.get(key)
                except NameEntryNotFound:  # (answered: not to be added back)
                    worker.name_resolve.forget(key)
                    log.warning("%s: checkpoint committed after SIGUSR2 (in %.0fs): stopping",
                                worker.name, time.monotonic() - t0)
                    break
            else:
                if not worker.stopping:  # (not: stopped meanwhile by another cause)
                    log.warning("%s: no checkpoint within %.0fs of SIGUSR2: stopping (the steps "
                                "since the last checkpoint are lost; a longer "
                                "scheduler.slurm.signal_seconds gives the checkpoint more "
                                "time)", worker.name, deadline - t0)
        finally:
            worker.stop()
    threading.Thread(target=wait, name="preempt", daemon=True).start()


def warning_needed(need: float) -> int:
    """The shortest ``scheduler.slurm.signal_seconds`` whose wait (:func:`checkpoint_wait` of a
    warning that long, as long before the end) is at least ``need`` seconds (pure)."""
    return math.ceil(2 * need if need <= STOP_RESERVE else need + STOP_RESERVE)


PREEMPT_READ_S = 1.5
"""Seconds, at most, before the master reads a preemption request once a step is done (it reads
them at most once a second, each wait for a trajectory lasting 0.5 s)."""

HEADROOM = 1.25
"""The ``signal_seconds`` a :class:`WindowCheck` asks for fits this much more than was needed
(checkpoints grow with the model, and vary), and it speaks again only once that is outgrown."""


class WindowCheck:
    """Whether the master's checkpoint, after the training part of the step that may be running
    when Slurm's warning comes (a preemption request is read, and the checkpoint taken, between
    steps: the wait for the batch never delays it), fits in what a warned worker waits for it;
    said once, and again only once the ``signal_seconds`` it asked for no longer fits."""

    def __init__(self, warning: float) -> None:
        self.warning = warning
        self.covered = 0.0  # what the value last asked for waits
        self.notes: list[str] = []
        """What was said, for the run's summary (printed as it ends)."""

    def check(self, cost: float, train_s: float) -> str:
        """The warning for a checkpoint of ``cost`` seconds after ``train_s`` seconds of a step's
        training; '' when it fits, when said already, or with no Slurm warning to fit in."""
        need = cost + train_s
        wait = checkpoint_wait(None, self.warning)
        if not self.warning or need <= max(wait, self.covered):
            return ""
        asked = warning_needed(need * HEADROOM)
        self.covered = checkpoint_wait(None, asked)
        note = (f"a step's training and its checkpoint took {_s(train_s)} + {_s(cost)}: more "
                f"than the {_s(wait)} a worker warned by Slurm waits for the checkpoint "
                f"(scheduler.slurm.signal_seconds={self.warning:.0f} less "
                f"{_s(reserve(self.warning))} for the stop and requeue), so a time limit would "
                "lose the steps since the last checkpoint; valid: "
                f"scheduler.slurm.signal_seconds={asked} or more (a preemption's wait is what "
                "the partition's GraceTime leaves)")
        self.notes.append(note)
        return note


def _s(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
