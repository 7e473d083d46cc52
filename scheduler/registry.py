"""Build the scheduler a config names."""
from __future__ import annotations

import os

from scheduler.base import Scheduler
from scheduler.config import SchedulerConfig, SchedulerKind
from system.paths import PROJECT_ROOT


def make_scheduler(sched: SchedulerConfig, exp: str, trial: str, trial_dir: str,
                   umask: int = 0o077) -> Scheduler:
    """The scheduler ``sched`` names, for trial ``exp/trial`` in ``trial_dir``; its jobs create
    files under ``umask`` (local workers inherit the launcher's)."""
    if sched.type == SchedulerKind.SLURM:
        from scheduler.slurm import SlurmScheduler

        # absolute: the job's scripts start where sbatch ran (here), and `cd -x` or `cd -`
        # would read a relative directory that starts with '-' as an option
        return SlurmScheduler(sched.slurm, exp, trial, trial_dir,
                              os.path.abspath(sched.slurm.workdir or PROJECT_ROOT), umask)
    from scheduler.local import LocalScheduler

    return LocalScheduler(spares=sched.spares)
