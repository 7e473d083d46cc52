"""Can a trial's groups ever run at the same time on their partitions? (pure)

Each group's job needs ``nodes`` node slots, each asking for the same CPUs, GPUs and memory
(:class:`Demand`). Without ``hetjob`` the groups are separate jobs: their slots may share a
node, a job's own slots may not (its nodes are distinct). With ``hetjob`` the trial is one
heterogeneous job whose components never share a node: every slot needs its own node. The
check packs the slots into the partition's nodes (:class:`Node`, from ``scontrol show node``)
by a bounded exact search and reports the smallest set of groups that can never fit together.
Only what the scripts ask for counts: a group's ``--mem`` (none: not checked), its nodes'
configured CPUs, GPUs and memory (not what is free now: busy nodes clear, a too-small
partition does not). ``nodelist``, ``exclude`` and ``constraint`` narrow nodes further; they
are left to Slurm (``sbatch --test-only`` checks each group alone).
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Sequence

SEARCH_STEPS = 200_000
"""Past this many placement steps the search gives up and calls the groups fitting (the
pre-flight refuses only what can certainly never run)."""


@dataclasses.dataclass(frozen=True)
class Node:
    """One node's configured resources."""

    name: str
    cpus: int
    gpus: int
    mem_mb: int
    partitions: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one group's job asks of each of its ``nodes`` nodes."""

    kind: str
    partition: str
    nodes: int
    cpus: int
    gpus: int
    mem_mb: int
    exclusive: bool = False

    def text(self) -> str:
        parts = [f"{self.cpus} CPUs"] + ([f"{self.gpus} GPUs"] if self.gpus else []) + (
            [f"{self.mem_mb}M"] if self.mem_mb else [])
        what = "a whole node" if self.exclusive else ", ".join(parts)
        return f"{self.kind} {what}" + (f" on each of {self.nodes} nodes" if self.nodes > 1
                                        else "")


_MEM_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def mem_mb(text: str) -> int:
    """``64G`` -> 65536; ``16000`` (megabytes) -> 16000; empty -> 0."""
    if not text:
        return 0
    unit = text[-1].upper() if text[-1].isalpha() else "M"
    number = text[:-1] if text[-1].isalpha() else text
    return int(int(number) * _MEM_UNITS[unit])


def _gpu_count(gres: str) -> int:
    """``gpu:4``, ``gpu:a100:4(S:0-1)``, ``gpu:a100:2,gpu:v100:2`` -> GPUs (0 for ``(null)``)."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item)
        if m:
            total += int(m.group(1))
    return total


def parse_nodes(text: str) -> list[Node]:
    """``scontrol show node -o`` (one line of ``Key=Value`` pairs per node)."""
    nodes = []
    for line in text.splitlines():
        kv = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" not in kv:
            continue
        cpus = kv.get("CPUEfctv") or kv.get("CPUTot") or "0"
        nodes.append(Node(kv["NodeName"], int(cpus), _gpu_count(kv.get("Gres", "")),
                          int(kv.get("RealMemory", "0") or 0),
                          tuple(p for p in kv.get("Partitions", "").split(",") if p)))
    return nodes


def default_partition(text: str) -> str:
    """The ``Default=YES`` partition of ``scontrol show partition -o`` ('' if none)."""
    for line in text.splitlines():
        kv = dict(re.findall(r"(\w+)=(\S*)", line))
        if kv.get("Default") == "YES":
            return kv.get("PartitionName", "")
    return ""


class _Packer:
    """Bounded exact search: can every slot be placed on ``nodes``?"""

    def __init__(self, nodes: Sequence[Node], dims: tuple[int, ...], one_per_node: bool) -> None:
        self.caps = [(n.cpus, n.gpus, n.mem_mb) for n in nodes]
        self.dims, self.one_per_node = dims, one_per_node
        self.steps = 0

    def fits(self, demands: Sequence[Demand]) -> bool | None:
        """True/False, or None when the search ran out of steps."""
        slots = sorted(((d.exclusive, d.cpus, d.gpus, d.mem_mb, i) for i, d in enumerate(demands)
                        for _ in range(d.nodes)), reverse=True)
        used = [[0, 0, 0] for _ in self.caps]
        owners: list[set[int]] = [set() for _ in self.caps]
        try:
            return self._place(slots, 0, used, owners)
        except _OutOfSteps:
            return None

    def _place(self, slots: list, k: int, used: list[list[int]], owners: list[set[int]]) -> bool:
        if k == len(slots):
            return True
        self.steps += 1
        if self.steps > SEARCH_STEPS:
            raise _OutOfSteps
        exclusive, *need, job = slots[k]
        tried = set()
        for n, cap in enumerate(self.caps):
            state = (cap, tuple(used[n]), bool(owners[n]))
            if job in owners[n] or state in tried:
                continue  # a job's nodes are distinct; an identical node was tried already
            tried.add(state)
            if (self.one_per_node or exclusive) and owners[n]:
                continue
            if any(used[n][d] + need[d] > cap[d] for d in self.dims):
                continue
            old = list(used[n])
            used[n] = list(cap) if exclusive else [u + x for u, x in zip(used[n], need)]
            owners[n].add(job)
            if self._place(slots, k + 1, used, owners):
                return True
            used[n] = old
            owners[n].discard(job)
        return False


class _OutOfSteps(Exception):
    pass


_DIMS = {0: ("CPUs", "cpus_per_task"), 1: ("GPUs", "gpus_per_node"), 2: ("memory", "mem")}


def _never_fit(demands: Sequence[Demand], nodes: Sequence[Node], hetjob: bool) -> bool:
    return _Packer(nodes, (0, 1, 2), hetjob).fits(demands) is False


def co_schedule_problem(demands: Sequence[Demand], nodes: Sequence[Node], hetjob: bool
                        ) -> str | None:
    """One line naming the smallest set of groups that can never run at once on their shared
    partition, and the keys to change; None when every partition can hold its groups."""
    by_partition: dict[str, list[Demand]] = {}
    for d in demands:
        by_partition.setdefault(d.partition, []).append(d)
    for partition, group in by_partition.items():
        members = [n for n in nodes if partition in n.partitions]
        if not members:
            continue  # a partition we cannot see: sbatch says what is wrong with it
        for d in group:
            if _never_fit([d], members, False):
                return _message([d], partition, members, False)
        if hetjob:  # one job: all its components on the partition at once, or none
            if _never_fit(group, members, True):
                return _message(group, partition, members, True)
            continue
        for size in range(2, len(group) + 1):
            for subset in itertools.combinations(group, size):
                if _never_fit(subset, members, False):
                    return _message(subset, partition, members, False)
    return None


def _shape(nodes: Sequence[Node]) -> str:
    shapes = sorted({(n.cpus, n.gpus, n.mem_mb) for n in nodes}, reverse=True)
    text = "; ".join(f"{c} CPUs, {g} GPUs, {m}M" for c, g, m in shapes[:3])
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: {text}" + (
        " each" if len(shapes) == 1 and len(nodes) > 1 else "")


def _message(subset: Sequence[Demand], partition: str, nodes: Sequence[Node],
             hetjob: bool) -> str:
    kinds = [d.kind for d in subset]
    named = " and ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)
    asks = "; ".join(d.text() for d in subset)
    if hetjob:
        slots = sum(d.nodes for d in subset)
        return (f"scheduler.slurm.hetjob=true can never start on partition {partition} "
                f"({_shape(nodes)}): a heterogeneous job's components never share a node, and "
                f"its {named} components need {slots} nodes of their own ({asks}); set "
                "scheduler.slurm.hetjob=false, or "
                "use a partition with more nodes (scheduler.slurm.partition)")
    blocking = [d for d in _DIMS if _Packer(nodes, (d,), False).fits(subset) is False]
    keys = [_DIMS[d][1] for d in blocking] or ["nodes", "cpus_per_task", "gpus_per_node", "mem"]
    what = ", ".join(_DIMS[d][0] for d in blocking) or "resources"
    change = " or ".join(f"scheduler.slurm.{k}.{key}" for k in kinds for key in keys)
    together = "at once " if len(kinds) > 1 else ""
    return (f"the {named} group{'s' if len(kinds) > 1 else ''} can never run {together}on "
            f"partition {partition} "
            f"({_shape(nodes)}): not enough {what} per node for {asks}; lower {change}, or "
            f"put a group on another partition (scheduler.slurm.<group>.partition)")
