"""Pending jobs: which of Slurm's pending reasons can never clear, and what to change (pure).

Slurm gives a pending job a reason (``squeue -o %r``; the list is "JOB REASON CODES" in
``man squeue`` and https://slurm.schedmd.com/job_reason_codes.html). Most of them clear by
waiting (``Resources``, ``Priority``, ``QOSMaxCpuPerUserLimit``: the user's other jobs end,
``BeginTime``, ``Dependency``...). The ones in :data:`HOPELESS` are decided by the request
itself against the partition's, account's or QOS's configuration: waiting changes nothing,
only a different request (or an administrator) does. A job pending with one of them fails the
trial at once with :func:`blocked_message`.
"""
from __future__ import annotations

import re

_RESOURCES = ("nodes", "cpus_per_task", "gpus_per_node", "mem")

HOPELESS: dict[str, tuple[str, tuple[str, ...]]] = {
    "PartitionConfig": ("the request does not fit the partition's configuration",
                        ("partition", "time", *_RESOURCES)),
    "PartitionNodeLimit": ("the nodes asked for are outside the partition's limits (or every "
                           "node that could hold them is down or drained)",
                           ("nodes", "partition")),
    "PartitionTimeLimit": ("the time limit is above the partition's", ("time", "partition")),
    "InvalidAccount": ("the account is not valid for this user or partition", ("account",)),
    "InvalidQOS": ("the QOS is not valid for this user, account or partition", ("qos",)),
    "BadConstraints": ("no node has the features asked for", ("constraint",)),
    "DependencyNeverSatisfied": ("a dependency can never be met", ("extra_sbatch",)),
    "AccountNotAllowed": ("the partition does not admit the account", ("account", "partition")),
    "QOSNotAllowed": ("the partition does not admit the QOS", ("qos", "partition")),
}
"""Reason -> (what it means, the group's keys that change it)."""

_PER_JOB = re.compile(r"(QOS|Assoc)(Grp)?Max(\w*?)(PerJob|PerNode)(Limit)?$")
"""A per-job (or per-node) maximum of a QOS or association: above it, a job never starts
(``QOSMaxCpuPerJobLimit``, ``QOSMaxGRESPerJob``, ``AssocMaxNodesPerJobLimit``, ...). The
per-user and group totals (``QOSMaxCpuPerUserLimit``, ``AssocGrpCpuLimit``) clear as other jobs
end and are not here."""

_LIMIT_KEYS = {"Cpu": ("cpus_per_task",), "CPU": ("cpus_per_task",), "Node": ("nodes",),
               "Nodes": ("nodes",), "GRES": ("gpus_per_node",), "TRES": _RESOURCES,
               "Mem": ("mem",), "Memory": ("mem",), "Wall": ("time",),
               "WallDuration": ("time",)}


def unavailable_nodes(reason: str) -> list[str]:
    """The nodes of ``ReqNodeNotAvail, UnavailableNodes:a,b`` (Slurm's own hostlist text,
    e.g. ``rlnode[2-3]``, is returned as it is)."""
    _, _, tail = reason.partition("UnavailableNodes:")
    return [n for n in re.split(r",(?![^\[]*\])", tail.strip()) if n]


def hopeless(reason: str, unknown_nodes: bool = False) -> tuple[str, tuple[str, ...]] | None:
    """What the pending ``reason`` means and which group keys change it, when it can never
    clear by waiting; None when it can. ``ReqNodeNotAvail`` (nodes down, drained or reserved)
    clears when they come back, so it counts only with ``unknown_nodes`` (a node the job asks
    for does not exist)."""
    word = reason.split(",")[0].strip()
    if word in HOPELESS:
        return HOPELESS[word]
    if word == "ReqNodeNotAvail" and unknown_nodes:
        return "a node asked for does not exist", ("nodelist", "exclude")
    m = _PER_JOB.match(word)
    if m and m.group(2) is None:
        what = m.group(3)
        keys = _LIMIT_KEYS.get(what, _RESOURCES)
        source = "QOS" if m.group(1) == "QOS" else "association (account)"
        return (f"the request is above the {source}'s per-job {what or 'resource'} limit",
                (*keys, "qos" if m.group(1) == "QOS" else "account"))
    return None


def held_after_launch_failure(reason: str) -> bool:
    """Whether Slurm held a pending job because its launch failed (``launch failed requeued
    held``: its node failed as the job started; priority 0 until someone releases it). Not
    an administrator's or the user's own hold (``JobHeldAdmin``, ``JobHeldUser``)."""
    return reason.strip().lower().startswith("launch failed requeued held")


def keys_text(kind: str, keys: tuple[str, ...]) -> str:
    """``scheduler.slurm.model.cpus_per_task or scheduler.slurm.model.qos``."""
    return " or ".join(f"scheduler.slurm.{kind}.{k}" for k in keys)


def blocked_message(kind: str, job_id: str, reason: str, meaning: str,
                    keys: tuple[str, ...]) -> str:
    """One line: the group, the job, Slurm's reason and what it means, the keys to change."""
    return (f"the {kind} group can never start: job {job_id} is pending with reason {reason} "
            f"({meaning}); change {keys_text(kind, keys)}")


def queue_timeout_message(kind: str, job_id: str, reason: str, waited: float,
                          limit: float) -> str:
    """One line: the group waited longer than ``scheduler.slurm.queue_timeout``."""
    return (f"the {kind} group did not start: job {job_id} waited {waited:.0f}s in the queue "
            f"(reason {reason or 'unknown'}), past scheduler.slurm.queue_timeout={limit:g}")
