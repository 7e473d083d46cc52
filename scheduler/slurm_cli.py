"""Running Slurm's commands and reading what they print: one place that turns a missing or
silent command into SchedulerError, and one table from Slurm's job states to
:class:`~scheduler.jobs.JobState` (unknown ones become UNKNOWN)."""
from __future__ import annotations

import re
import subprocess
from typing import Sequence

from scheduler.jobs import JobState
from system.errors import SchedulerError

STATE_TABLE: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "SUSPENDED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "REQUEUED": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,
    "FAILED": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "BOOT_FAIL": JobState.NODE_FAIL,
    "NODE_FAIL": JobState.NODE_FAIL,
    "PREEMPTED": JobState.PREEMPTED,
    "TIMEOUT": JobState.TIMEOUT,
    "DEADLINE": JobState.TIMEOUT,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
}


QUEUED_STATES = frozenset(raw for raw, state in STATE_TABLE.items()
                          if state in (JobState.PENDING, JobState.RUNNING, JobState.REQUEUED))
"""Raw Slurm states of a job still in the queue (squeue lists it)."""

ENDING_STATES = frozenset({"COMPLETING", "STAGE_OUT"})
"""Queued states of a job whose processes have ended (a cancel could not hurry it)."""


def map_state(raw: str) -> JobState:
    """``"CANCELLED by 0"`` -> CANCELLED; ``"CD"``-style or unknown strings -> UNKNOWN."""
    word = raw.strip().split(" ")[0].upper().rstrip("+")
    return STATE_TABLE.get(word, JobState.UNKNOWN)


def parse_sbatch_parsable(out: str) -> str:
    """``sbatch --parsable`` prints ``jobid`` or ``jobid;cluster``."""
    job_id = out.strip().splitlines()[-1].split(";")[0] if out.strip() else ""
    if not job_id.isdigit():
        raise SchedulerError(f"unexpected sbatch output {out.strip()!r}")
    return job_id


def parse_scontrol_job(line: str) -> dict[str, str]:
    """``scontrol show job -o`` prints one line of ``Key=Value`` pairs."""
    return dict(m.group(1, 2) for m in re.finditer(r"(\w+)=(\S*)", line))


def run(argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``argv`` (output captured as text); SchedulerError when the command does not exist
    or does not answer within ``timeout`` seconds (its exit status is the caller's to judge)."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise SchedulerError(f"{argv[0]} not found: is this a Slurm login node?") from e
    except subprocess.TimeoutExpired as e:
        raise SchedulerError(f"{' '.join(argv)} did not answer within {timeout:.0f}s") from e


UNREACHABLE = ("unable to contact slurm controller", "could not establish a configuration source",
               "socket timed out", "connection refused", "connection timed out",
               "slurm_persist_conn_open", "zero bytes were transmitted or received",
               "unable to process configuration file")
"""What Slurm's commands say when they cannot talk to slurmctld (down, restarting, or a node
whose Slurm configuration is missing or broken): not a judgement of the request."""


def unreachable(r: subprocess.CompletedProcess) -> bool:
    """Whether a failed Slurm command failed because slurmctld could not be reached."""
    text = f"{r.stderr}\n{r.stdout}".lower()
    return any(s in text for s in UNREACHABLE)


def last_error(r: subprocess.CompletedProcess) -> str:
    """The last line Slurm printed, without its ``sbatch: error:`` prefixes."""
    text = (r.stderr.strip() or r.stdout.strip()).splitlines()
    line = text[-1] if text else f"exit status {r.returncode}"
    while ": error: " in line or line.startswith("error: "):
        line = line.split("error: ", 1)[1]
    return line.strip()
