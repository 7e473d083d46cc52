"""Running Slurm's commands: one place that turns a missing or silent command into
SchedulerError."""
from __future__ import annotations

import subprocess
from typing import Sequence

from system.errors import SchedulerError


def run(argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``argv`` (output captured as text); SchedulerError when the command does not exist
    or does not answer within ``timeout`` seconds (its exit status is the caller's to judge)."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise SchedulerError(f"{argv[0]} not found: is this a Slurm login node?") from e
    except subprocess.TimeoutExpired as e:
        raise SchedulerError(f"{' '.join(argv)} did not answer within {timeout:.0f}s") from e


def last_error(r: subprocess.CompletedProcess) -> str:
    """The last line Slurm printed, without its ``sbatch: error:`` prefixes."""
    text = (r.stderr.strip() or r.stdout.strip()).splitlines()
    line = text[-1] if text else f"exit status {r.returncode}"
    while ": error: " in line or line.startswith("error: "):
        line = line.split("error: ", 1)[1]
    return line.strip()
