"""How long a process warned by Slurm waits for the trial's checkpoint, and whether the master's
checkpoint fits that wait (pure).

Two kinds of process wait for it. A worker that holds training state, warned with its own job
(:mod:`workers.preempt_wait`), waits for what Slurm leaves less :func:`reserve`. A detached
controller that requeues its own job at its warning (:mod:`system.launcher.self_requeue`) asks
the master for the checkpoint, then must still stop every job and requeue itself: it waits
:func:`controller_checkpoint_wait`, less. :class:`WindowCheck` compares the master's step and
checkpoint with the shorter of the two that apply, and names the ``signal_seconds`` that fits.
"""
from __future__ import annotations

import math

PREEMPT_WAIT = 90.0
"""Seconds a warned worker waits for the checkpoint where nothing says when its job ends (the
local scheduler, a SIGUSR2 sent by hand): as long as Slurm's default 120 s warning allows."""

STOP_RESERVE = 30.0
"""Seconds kept, of what is left before Slurm ends the job, for the worker's stop, its srun's end
and the batch script's requeue (half of what is left, when that is under twice this)."""

CONTROLLER_MARGIN = 15.0
"""Seconds a warned controller keeps, beyond stopping every job, for its own requeue."""


def checkpoint_wait(left: float | None, warning: float) -> float:
    """Seconds a warned worker waits for the checkpoint, with ``left`` seconds before Slurm ends
    the job (None: unknown, taken as the warning's length) and a time-limit warning of
    ``warning`` seconds (0: none). What is left less its :func:`reserve`; at most what the
    warning itself leaves that way, or :data:`PREEMPT_WAIT` if more (a SIGUSR2 with no end
    near, sent by hand); :data:`PREEMPT_WAIT` where nothing says when the job ends."""
    if left is None:
        if not warning:
            return PREEMPT_WAIT
        left = warning
    cap = max(PREEMPT_WAIT, warning - reserve(warning))
    return max(min(left - reserve(left), cap), 0.0)


def reserve(left: float) -> float:
    """Seconds kept of ``left`` for the stop and the requeue: :data:`STOP_RESERVE`, or half of
    ``left`` when that is less."""
    return min(STOP_RESERVE, left / 2)


def warning_needed(need: float) -> int:
    """The shortest ``scheduler.slurm.signal_seconds`` whose wait (:func:`checkpoint_wait` of a
    warning that long, as long before the end) is at least ``need`` seconds."""
    return math.ceil(2 * need if need <= STOP_RESERVE else need + STOP_RESERVE)


def controller_checkpoint_wait(signal_seconds: float, stop_grace: float) -> float:
    """How long a warned detached controller waits for the checkpoint: at most half the
    warning, and no more than what it leaves once stopping every job (``stop_grace``, twice
    over: workers, then jobs) and :data:`CONTROLLER_MARGIN` are set aside; at least 10 s, or
    a third of a warning under 30 s (a preemption's grace time, say). The rest is for stopping
    the jobs and the requeue itself, before Slurm's kill at the limit."""
    return max(min(signal_seconds / 2, signal_seconds - controller_keeps(stop_grace)),
               min(10.0, signal_seconds / 3))


def controller_keeps(stop_grace: float) -> float:
    """Seconds of its warning a detached controller keeps to stop every job and requeue."""
    return 2 * stop_grace + CONTROLLER_MARGIN


def controller_warning_needed(need: float, stop_grace: float) -> int:
    """The shortest ``scheduler.slurm.signal_seconds`` whose :func:`controller_checkpoint_wait`
    is at least ``need`` seconds."""
    enough = max(2 * need, need + controller_keeps(stop_grace))
    if need <= 10.0:
        enough = min(enough, 3 * need)
    return math.ceil(enough)


PREEMPT_READ_S = 1.5
"""Seconds, at most, before the master reads a preemption request once a step is done (it reads
them at most once a second, each wait for a trajectory lasting 0.5 s)."""

HEADROOM = 1.25
"""The ``signal_seconds`` a :class:`WindowCheck` asks for fits this much more than was needed
(checkpoints grow with the model, and vary), and it speaks again only once that is outgrown."""


class WindowCheck:
    """Whether the master's checkpoint, after the training part of the step that may be running
    when Slurm's warning comes (a preemption request is read, and the checkpoint taken, between
    steps: the wait for the batch never delays it), fits in what a warned worker waits for it,
    and, with ``controller_grace`` (the ``scheduler.stop_grace`` of a detached controller that
    requeues itself at its warning; None: none does), in what that controller waits; said
    once, and again only once the ``signal_seconds`` it asked for no longer fits."""

    def __init__(self, warning: float, controller_grace: float | None = None) -> None:
        self.warning = warning
        self.controller_grace = controller_grace
        self.covered = 0.0  # what the value last asked for waits
        self.notes: list[str] = []
        """What was said, for the run's summary (printed as it ends)."""

    def wait(self, warning: float) -> float:
        """What the shortest wait for the checkpoint is, with a warning of ``warning`` s."""
        wait = checkpoint_wait(None, warning)
        if self.controller_grace is None:
            return wait
        return min(wait, controller_checkpoint_wait(warning, self.controller_grace))

    def needed(self, need: float) -> int:
        """The shortest ``signal_seconds`` whose :meth:`wait` is at least ``need`` seconds."""
        if self.controller_grace is None:
            return warning_needed(need)
        return max(warning_needed(need), controller_warning_needed(need, self.controller_grace))

    def check(self, cost: float, train_s: float) -> str:
        """The warning for a checkpoint of ``cost`` seconds after ``train_s`` seconds of a step's
        training; '' when it fits, when said already, or with no Slurm warning to fit in."""
        need = cost + train_s
        wait = self.wait(self.warning)
        if not self.warning or need <= max(wait, self.covered):
            return ""
        asked = self.needed(need * HEADROOM)
        self.covered = self.wait(asked)
        if wait < checkpoint_wait(None, self.warning):
            assert self.controller_grace is not None
            who = ("the detached controller warned by Slurm waits for the checkpoint (half of "
                   f"scheduler.slurm.signal_seconds={self.warning:.0f}, or all of it but the "
                   f"{_s(controller_keeps(self.controller_grace))} it keeps to stop every job and "
                   "requeue itself, whichever is less, but at least a third of it, up to 10s)")
        else:
            who = (f"a worker warned by Slurm waits for the checkpoint "
                   f"(scheduler.slurm.signal_seconds={self.warning:.0f} less "
                   f"{_s(reserve(self.warning))} for the stop and requeue)")
        note = (f"a step's training and its checkpoint took {_s(train_s)} + {_s(cost)}: more "
                f"than the {_s(wait)} {who}, so a time limit would lose the steps since the "
                f"last checkpoint; valid: scheduler.slurm.signal_seconds={asked} or more (a "
                "preemption's wait is what the partition's GraceTime leaves)")
        self.notes.append(note)
        return note


def _s(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
