"""What a scheduler reports of a job: one :class:`JobState` vocabulary and :class:`JobStatus`."""
from __future__ import annotations

import dataclasses
import enum


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
class JobStatus:
    """What a scheduler knows of one job (a local worker, or a whole group under Slurm)."""

    job_id: str
    state: JobState
    workers: tuple[str, ...]
    log_paths: tuple[str, ...]
    detail: str = ""
    restarts: int = 0
    """How many times the job was requeued (a restarted job's workers rejoin the trial)."""
    reason: str = ""
    """Why a pending job waits, as the scheduler says it (Slurm: squeue's reason, e.g.
    ``Resources``, ``Priority``, ``QOSMaxCpuPerJobLimit``); empty for a job not pending."""
    blocked: str = ""
    """Non-empty when the scheduler judged that the job cannot start: a pending reason that
    cannot clear, or longer in the queue than allowed. One line naming the group, the reason
    and the key to change; the trial fails with it."""

    @property
    def queued(self) -> bool:
        """Waiting in the queue to start (pending or requeued)."""
        return self.state in (JobState.PENDING, JobState.REQUEUED)
