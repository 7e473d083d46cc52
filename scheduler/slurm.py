"""Slurm scheduler: one sbatch job per worker group, tracked with squeue / scontrol.

Nothing here depends on ``sacct`` (many clusters have no accounting storage). Raw Slurm states map
through :data:`STATE_TABLE` to :class:`~scheduler.base.JobState`; unknown ones become UNKNOWN.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
import time
from typing import Sequence

from scheduler.base import GroupSpec, JobRequest, JobState, JobStatus, Scheduler
from scheduler.requeue import RequeuePolicy
from scheduler.slurm_config import SlurmConfig
from scheduler.slurm_render import job_name, render_worker_script
from system.errors import SchedulerError

log = logging.getLogger("slurm")

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


@dataclasses.dataclass(frozen=True)
class SlurmRequest(JobRequest):
    group: GroupSpec
    script_path: str
    script: str

    def materialize(self) -> str:
        return self.script

    def write(self) -> str:
        os.makedirs(os.path.dirname(self.script_path), exist_ok=True)
        with open(self.script_path, "w") as f:
            f.write(self.script)
        os.chmod(self.script_path, 0o755)
        return self.script_path


def _run(argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise SchedulerError(f"{argv[0]} not found: is this a Slurm login node?") from e
    except subprocess.TimeoutExpired as e:
        raise SchedulerError(f"{' '.join(argv)} did not answer within {timeout:.0f}s") from e


class SlurmScheduler(Scheduler):
    def __init__(self, slurm: SlurmConfig, exp: str, trial: str, trial_dir: str, workdir: str
                 ) -> None:
        self.slurm = slurm
        self.exp, self.trial = exp, trial
        self.trial_dir = trial_dir
        self.workdir = workdir
        self._jobs: dict[str, GroupSpec] = {}
        self._last_poll = 0.0
        self._cache: list[JobStatus] = []

    @property
    def python(self) -> str:
        return self.slurm.python or sys.executable

    def requeue_policy(self) -> RequeuePolicy:
        return RequeuePolicy(requeue=self.slurm.requeue, rejoin_timeout=self.slurm.rejoin_timeout,
                             requeue_grace=self.slurm.requeue_grace)

    # --- pure ---
    def plan(self, group: GroupSpec) -> SlurmRequest:
        script = render_worker_script(
            exp=self.exp, trial=self.trial, kind=group.kind, count=group.count, slurm=self.slurm,
            argv=group.argv, env=group.env,
            logs_dir=os.path.dirname(group.log_paths[0]), workdir=self.workdir)
        return SlurmRequest(group, os.path.join(self.trial_dir, "jobs", f"{group.kind}.sbatch"),
                            script)

    # --- effects ---
    def schedule(self, request: JobRequest) -> list[str]:
        assert isinstance(request, SlurmRequest)
        path = request.write()
        r = _run(["sbatch", "--parsable", path])
        if r.returncode != 0:
            raise SchedulerError(f"sbatch {path} failed: {r.stderr.strip() or r.stdout.strip()}")
        job_id = parse_sbatch_parsable(r.stdout)
        self._jobs[job_id] = request.group
        self._last_poll = 0.0
        log.info("submitted %s as job %s", job_name(self.exp, self.trial, request.group.kind), job_id)
        return [job_id]

    @staticmethod
    def test_only(request: SlurmRequest) -> tuple[bool, str]:
        """Validate a written script with ``sbatch --test-only`` (nothing is queued)."""
        r = _run(["sbatch", "--test-only", request.write()])
        return r.returncode == 0, (r.stderr or r.stdout).strip()

    def poll(self, fresh: bool = False) -> list[JobStatus]:
        if not self._jobs:
            return []
        if not fresh and time.monotonic() - self._last_poll < self.slurm.poll_interval:
            return self._cache
        self._last_poll = time.monotonic()
        ids = list(self._jobs)
        found: dict[str, tuple[str, str]] = {}
        r = _run(["squeue", "-h", "--states=all", "-j", ",".join(ids), "-o", "%i|%T|%r"])
        if r.returncode == 0:
            for line in r.stdout.splitlines():
                parts = line.strip().split("|")
                if len(parts) == 3 and parts[0] in self._jobs:
                    found[parts[0]] = (parts[1], parts[2])
        else:
            log.warning("squeue failed: %s", r.stderr.strip())
        statuses = []
        for job_id, group in self._jobs.items():
            raw, reason = found.get(job_id, ("", ""))
            restarts = 0
            if fresh or not raw or map_state(raw) in (JobState.PENDING, JobState.REQUEUED):
                info = self._scontrol(job_id)  # finished jobs, and restart counts
                raw = raw or info.get("JobState", "")
                reason = reason or info.get("Reason", "")
                restarts = int(info.get("Restarts", "0") or 0)
            state = map_state(raw) if raw else JobState.UNKNOWN
            statuses.append(JobStatus(job_id, state, group.worker_names(), group.log_paths,
                                      f"job {job_id} {raw or 'not found'}"
                                      + (f" ({reason})" if reason and reason != "None" else ""),
                                      restarts))
        self._cache = statuses
        return statuses

    @staticmethod
    def _scontrol(job_id: str) -> dict[str, str]:
        r = _run(["scontrol", "show", "job", "-o", job_id])
        if r.returncode != 0 or not r.stdout.strip():
            return {}
        return parse_scontrol_job(r.stdout.strip().splitlines()[0])

    def stop_all(self, grace: float) -> None:
        if not self._jobs:
            return
        ids = list(self._jobs)
        _run(["scancel", "--signal=TERM", "--full", *ids])  # polite: workers stop gracefully
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
                s.state.active and s.state != JobState.UNKNOWN for s in self.poll(fresh=True)):
            time.sleep(0.5)
        _run(["scancel", *ids])  # whatever is left (pending or still running) is cancelled
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = [s for s in self.poll(fresh=True) if s.state.active and s.state != JobState.UNKNOWN]
            if not left:
                return
            time.sleep(0.5)
        raise SchedulerError(f"jobs still in the queue after scancel: "
                             f"{[s.job_id for s in left]}")
