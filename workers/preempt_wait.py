"""How long a warned worker has before Slurm ends its job, and the wait of one that holds training
state for the master's checkpoint within it.

Slurm's warning comes ``scheduler.slurm.signal_seconds`` before a time limit (SIGUSR2), and a
preemption with a ``GraceTime`` ends the job when the grace does (SIGTERM, read as SIGUSR2 by
:meth:`~workers.base.Worker._on_signal`). A fixed wait fitted neither: 90 s outlived a 30 s
grace (the job was killed mid-wait, its requeue never asked for), and gave up on a checkpoint
that a warning of 600 s, set for a model whose checkpoint takes minutes, had room for (the steps
since the last checkpoint were lost). So the wait is what Slurm really leaves (``scontrol``: the
job's ``EndTime``, or its preemption's grace), less a reserve for the stop and the requeue that
follow; capped where no end is near (a SIGUSR2 sent by hand). The rule itself is pure, with what
the master checks its checkpoint against: :func:`workers.checkpoint_window.checkpoint_wait`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, ClassVar, Protocol

from system import names
from system.bootstrap import Bootstrap
from system.name_resolve_api import NameEntryNotFound, NameResolveError
from workers.checkpoint_window import checkpoint_wait

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


LOOK_TIMEOUT = 3.0
"""Seconds the look at the job (``scontrol``) may take; no answer: the warning's length."""


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
                if _committed(worker, key, t0):
                    break
            else:  # (stopped meanwhile by another cause: the controller's recovery, say, once
                # the master's job requeued after its commit; looked at once more)
                if not _committed(worker, key, t0) and not worker.stopping:
                    log.warning("%s: no checkpoint within %.0fs of SIGUSR2: stopping (the steps "
                                "since the last checkpoint are lost; a longer "
                                "scheduler.slurm.signal_seconds gives the checkpoint more "
                                "time)", worker.name, deadline - t0)
        finally:
            worker.stop()
    threading.Thread(target=wait, name="preempt", daemon=True).start()


def _committed(worker: Warned, key: str, t0: float) -> bool:
    """Whether the master has answered ``worker``'s checkpoint request ``key`` (deleted it once
    the checkpoint was committed); said if so. No answer from the name service: not yet."""
    try:
        worker.name_resolve.get(key)
    except NameEntryNotFound:  # (answered: not to be added back)
        worker.name_resolve.forget(key)
        log.warning("%s: checkpoint committed after SIGUSR2 (in %.0fs): stopping", worker.name,
                    time.monotonic() - t0)
        return True
    except NameResolveError:  # (an outage: looked at again, until the deadline)
        pass
    return False
