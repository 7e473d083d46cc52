"""Build the scheduler a config names."""
from __future__ import annotations

import os
from typing import Mapping, Sequence

from scheduler.base import Scheduler
from scheduler.config import SchedulerConfig, SchedulerKind
from scheduler.gpu_plan import GpuDemand
from system.paths import PROJECT_ROOT


def make_scheduler(sched: SchedulerConfig, exp: str, trial: str, trial_dir: str,
                   umask: int = 0o077, gpu_demands: Sequence[GpuDemand] = (),
                   counts: Mapping[str, int] | None = None) -> Scheduler:
    """The scheduler ``sched`` names, for trial ``exp/trial`` in ``trial_dir``; its jobs create
    files under ``umask`` (local workers inherit the launcher's). ``gpu_demands``: the GPUs
    each worker kind uses (local: placed, refused if too few are here; Slurm: requested and
    bound per task); ``counts``: workers per kind (local: their CPU sets)."""
    if sched.type == SchedulerKind.SLURM:
        from scheduler.slurm import SlurmScheduler

        # absolute: the job's scripts start where sbatch ran (here), and `cd -x` or `cd -`
        # would read a relative directory that starts with '-' as an option
        return SlurmScheduler(sched.slurm, exp, trial, trial_dir,
                              os.path.abspath(sched.slurm.workdir or PROJECT_ROOT), umask,
                              {d.kind: d.per_worker for d in gpu_demands})
    from scheduler.cpu_plan import CpuDemand, plan_cpus
    from scheduler.local import LocalScheduler, local_gpus

    gpus = local_gpus(sched.local.gpus, os.environ)
    weights = {d.kind: max(1, d.per_worker) for d in gpu_demands}
    demands = {d.kind: d.count for d in gpu_demands} | dict(counts or {})
    cpus = plan_cpus(sorted(os.sched_getaffinity(0)), sched.local.cpus,
                     [CpuDemand(k, n, weights.get(k, 1)) for k, n in demands.items()],
                     gpus=bool(gpus.ids), heavy={d.kind for d in gpu_demands})
    return LocalScheduler(gpus, gpu_demands, sched.local.share_gpus, spares=sched.local.spares,
                          cpus=cpus, spare_kinds=sched.local.kinds_with_spares())
