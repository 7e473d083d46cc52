"""Build the scheduler a config names."""
from __future__ import annotations

from typing import Any

from scheduler.base import Scheduler
from scheduler.config import SchedulerKind
from system.paths import PROJECT_ROOT



def make_scheduler(cfg: Any, trial_dir: str) -> Scheduler:
    if cfg.scheduler.type == SchedulerKind.SLURM:
        from scheduler.slurm import SlurmScheduler

        return SlurmScheduler(cfg.scheduler.slurm, cfg.exp, cfg.trial, trial_dir,
                              cfg.scheduler.slurm.workdir or PROJECT_ROOT)
    from scheduler.local import LocalScheduler

    return LocalScheduler()
