"""Build the scheduler a config names."""
from __future__ import annotations

from scheduler.base import Scheduler
from scheduler.config import SchedulerConfig, SchedulerKind
from system.paths import PROJECT_ROOT


def make_scheduler(sched: SchedulerConfig, exp: str, trial: str, trial_dir: str,
                   umask: int = 0o077) -> Scheduler:
    """The scheduler ``sched`` names, for trial ``exp/trial`` in ``trial_dir``; its jobs create
    files under ``umask`` (local workers inherit the launcher's)."""
    if sched.type == SchedulerKind.SLURM:
        from scheduler.slurm import SlurmScheduler

        return SlurmScheduler(sched.slurm, exp, trial, trial_dir,
                              sched.slurm.workdir or PROJECT_ROOT, umask)
    from scheduler.local import LocalScheduler

    return LocalScheduler()
