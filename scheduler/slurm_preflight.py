"""Before a trial submits anything: can its jobs ever run? (``sbatch --test-only`` per job,
and the co-scheduling check of :mod:`scheduler.slurm_fit` against ``scontrol show node``).

Each problem is one SchedulerError line naming the group(s) and the keys to change; what
cannot be read (``scontrol`` refused) is logged and not checked: the pre-flight refuses only
what can certainly never run."""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

from scheduler.base import GroupSpec
from scheduler.slurm_cli import last_error, run, unreachable
from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from scheduler.slurm_fit import co_schedule_problem, default_partition, parse_nodes
from scheduler.slurm_render import group_demand
from system.errors import SchedulerError

log = logging.getLogger("slurm")

_RESOURCE_KEYS = ("nodes", "ntasks_per_node", "cpus_per_task", "gpus_per_node", "mem",
                  "partition", "time", "exclusive", "constraint", "nodelist", "qos", "account")


def keys_set(kind: str, g: SlurmGroupConfig) -> str:
    """The resource keys group ``kind`` sets away from their defaults, as ``key=value``
    (or, when it sets none, the keys that could be changed)."""
    default = SlurmGroupConfig()
    changed = [f"scheduler.slurm.{kind}.{k}={getattr(g, k)}" for k in _RESOURCE_KEYS
               if getattr(g, k) != getattr(default, k)]
    if changed:
        return ", ".join(changed)
    return f"scheduler.slurm.{kind}.{{nodes,cpus_per_task,gpus_per_node,mem,partition}}"


def test_only(path: str) -> str | None:
    """``sbatch --test-only path``: None if Slurm would take it, else its last error line;
    SchedulerError when slurmctld cannot be reached (that says nothing of the job)."""
    r = run(["sbatch", "--test-only", path])
    if r.returncode != 0 and unreachable(r):
        raise SchedulerError(f"Slurm's controller cannot be reached: sbatch --test-only says "
                             f"{last_error(r)!r}; nothing was submitted (is slurmctld up, and "
                             "this node's Slurm configuration readable? `scontrol ping` tells)")
    return None if r.returncode == 0 else last_error(r)


def rejected(kind: str, g: SlurmGroupConfig, why: str) -> SchedulerError:
    return SchedulerError(f"the {kind} group can never run: sbatch --test-only rejects its job "
                          f"({why}); change {keys_set(kind, g)}")


def co_schedule(slurm: SlurmConfig, groups: Sequence[GroupSpec],
                gpus_per_worker: Mapping[str, int]) -> None:
    """SchedulerError when the groups can never run at the same time on their partitions
    (with ``hetjob``: never as one heterogeneous job)."""
    nodes_r = run(["scontrol", "show", "node", "-o"])
    parts_r = run(["scontrol", "show", "partition", "-o"])
    if nodes_r.returncode != 0 or parts_r.returncode != 0:
        log.warning("pre-flight: scontrol refused (%s); co-scheduling not checked",
                    last_error(nodes_r if nodes_r.returncode else parts_r))
        return
    default = default_partition(parts_r.stdout)
    demands = [group_demand(g.kind, g.count, slurm, gpus_per_worker.get(g.kind, 0), default)
               for g in groups if g.count]
    problem = co_schedule_problem(demands, parse_nodes(nodes_r.stdout), slurm.hetjob)
    if problem:
        raise SchedulerError(problem)
