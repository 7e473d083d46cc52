"""The scheduler interface: submit worker groups, report job states, stop everything."""
from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Mapping, Sequence

from system.errors import ConfigError


class SchedulerKind(str, enum.Enum):
    LOCAL = "local"
    SLURM = "slurm"


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
        return self in (JobState.PENDING, JobState.RUNNING, JobState.REQUEUED)

    @property
    def failed(self) -> bool:
        return self in (JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED, JobState.TIMEOUT,
                        JobState.NODE_FAIL, JobState.OUT_OF_MEMORY)


@dataclasses.dataclass
class SchedulerConfig:
    """How worker jobs are started."""

    type: SchedulerKind = SchedulerKind.LOCAL
    """``local`` (subprocesses on this machine) or ``slurm`` (sbatch jobs)."""
    stop_grace: float = 5.0
    """Seconds between the polite stop (SIGTERM) and SIGKILL."""

    def __post_init__(self) -> None:
        if isinstance(self.type, str) and not isinstance(self.type, SchedulerKind):
            try:
                self.type = SchedulerKind(self.type)
            except ValueError:
                raise ConfigError(f"scheduler.type={self.type!r} is not one of "
                                  f"{[k.value for k in SchedulerKind]}") from None
        if self.stop_grace < 0:
            raise ConfigError(f"scheduler.stop_grace must be >= 0, got {self.stop_grace}")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker process to start."""

    kind: str
    index: int
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: str

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.index}"


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """What a scheduler knows of one job (a worker, or a group of workers under Slurm)."""

    job_id: str
    state: JobState
    workers: tuple[str, ...]
    log_paths: tuple[str, ...]
    detail: str = ""


class Scheduler(abc.ABC):
    """Starts worker groups and tracks them. Only :meth:`submit` and :meth:`stop_all` have
    side effects on the outside world."""

    @abc.abstractmethod
    def submit(self, kind: str, workers: Sequence[WorkerSpec]) -> list[str]:
        """Start every worker of one group; returns job ids."""

    @abc.abstractmethod
    def poll(self) -> list[JobStatus]:
        """Current state of every job submitted so far."""

    @abc.abstractmethod
    def stop_all(self, grace: float) -> None:
        """Stop every job of the trial: polite signal, then kill after ``grace`` seconds.
        Must leave nothing running."""
