"""Files in a trial's logs directory that a Slurm job's batch script and its workers read: the
mark that asks for the job's requeue, and the marks of workers restarted elsewhere while the job
ran on (each file is named after the job).

A job of several workers runs on when one of them is restarted alone in a job of its own (Slurm
cannot stop one task of a step); that job is then set never to requeue. Should it requeue all the
same (Slurm did not take ``Requeue=0`` in time), its script starts every task again, the one
restarted elsewhere included: that copy finds its mark and exits at once, instead of registering
over its replacement's name.
"""
from __future__ import annotations

import glob
import os

REQUEUE_MARK_ENV = "RLSYS_REQUEUE_MARK"
"""The job's requeue mark (its path), exported to its tasks by the batch script (requeue on)."""


def requeue_mark_prefix(logs_dir: str, kind: str) -> str:
    """Job ``J`` of ``kind`` is marked for a requeue by the file ``<prefix>J``: a worker that got
    SIGUSR2 creates it, the job's script requeues the job once srun has returned."""
    return os.path.join(logs_dir, f".requeue-{kind}-")


def forgotten_mark(requeue_mark: str, index: int) -> str:
    """The file that says worker ``index`` of the job whose requeue mark is ``requeue_mark`` was
    restarted elsewhere: a copy of it started by the job's requeue must exit."""
    return f"{requeue_mark}.forgotten-{index}"


def forgotten_here(index: int) -> str | None:
    """The mark of this task (worker ``index``, in a Slurm job with requeue on) if it was
    restarted elsewhere while its job ran on: it is a copy the job started again (its
    requeue); None otherwise."""
    mark = os.environ.get(REQUEUE_MARK_ENV)
    if not mark or not os.path.exists(forgotten_mark(mark, index)):
        return None
    return forgotten_mark(mark, index)


def clear_forgotten(requeue_mark: str) -> None:
    """Remove the marks under job mark ``requeue_mark``: the job was just submitted, so none is
    its own (an earlier job Slurm numbered alike left them: its job ids started over)."""
    for path in glob.glob(glob.escape(requeue_mark) + ".forgotten-*"):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
