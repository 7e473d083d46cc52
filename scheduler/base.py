"""The scheduler interface: plan (pure) and schedule worker groups, report states, stop all.

As in TorchX, ``submit = schedule(plan(group))``: :meth:`Scheduler.plan` returns a
:class:`JobRequest` whose :meth:`~JobRequest.materialize` is the script or command text (what
``--dry-run`` shows); only :meth:`Scheduler.schedule` and :meth:`Scheduler.stop_all` act.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Mapping



class JobState(str, enum.Enum):
    """One state vocabulary for every scheduler (raw states map through one table each)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    UNKNOWN = "UNKNOWN"

    @property
    def active(self) -> bool:
        """Still queued or running (UNKNOWN counts: absence of news is not a failure)."""
        return self in (JobState.PENDING, JobState.RUNNING, JobState.REQUEUED, JobState.UNKNOWN)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One worker group: ``count`` processes running ``argv``; worker ``i`` logs to
    ``log_paths[i]``. The worker index is added by the scheduler (local: ``--index``; Slurm:
    each task derives it from its environment)."""

    kind: str
    count: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_paths: tuple[str, ...]

    def worker_names(self) -> tuple[str, ...]:
        return tuple(f"{self.kind}/{i}" for i in range(self.count))


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """What a scheduler knows of one job (a local worker, or a whole group under Slurm)."""

    job_id: str
    state: JobState
    workers: tuple[str, ...]
    log_paths: tuple[str, ...]
    detail: str = ""
    restarts: int = 0
    """How many times the job was requeued (a restarted job's workers rejoin the trial)."""


class JobRequest(abc.ABC):
    """What :meth:`Scheduler.schedule` will submit; ``materialize()`` is its text."""

    group: GroupSpec

    @abc.abstractmethod
    def materialize(self) -> str: ...


class Scheduler(abc.ABC):
    @abc.abstractmethod
    def plan(self, group: GroupSpec) -> JobRequest:
        """Pure: the request that would start ``group``."""

    @abc.abstractmethod
    def schedule(self, request: JobRequest) -> list[str]:
        """Start the request's workers; returns job ids."""

    def submit(self, group: GroupSpec) -> list[str]:
        return self.schedule(self.plan(group))

    @abc.abstractmethod
    def poll(self, fresh: bool = False) -> list[JobStatus]:
        """Current state of every job submitted so far (``fresh``: bypass any caching)."""

    @abc.abstractmethod
    def stop_all(self, grace: float) -> None:
        """Stop every job of the trial; must leave nothing running or queued."""
