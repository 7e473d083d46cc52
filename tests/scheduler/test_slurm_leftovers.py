"""Which queued jobs a new run of a trial cancels as left by its dead controller (pure over
squeue's lines; the whole path runs on the test Slurm in tests/scheduler/test_slurm_e2e.py)."""
from __future__ import annotations

import os

from scheduler.slurm_jobs import parse_named
from scheduler.slurm_leftovers import leftover_jobs

LOGS = "/r/fa/smoke/t1/logs"


def _ids(*lines: str, logs: str = LOGS) -> list[str]:
    jobs = parse_named("".join(f"{line}\n" for line in lines))
    dirs = {logs, os.path.join(os.path.dirname(logs), "eval", "logs")}
    return [j.job_id for j in leftover_jobs(jobs, "smoke", "t1", dirs)]


def test_the_trials_worker_jobs_in_its_logs_are_leftovers():
    assert _ids(f"10|RUNNING|smoke_t1:model|{LOGS}/slurm-model-10.log",
                f"11|PENDING|smoke_t1:rollout|{LOGS}/slurm-rollout-%j.log",
                f"12+0|RUNNING|smoke_t1:hetjob|{LOGS}/slurm-hetjob-12.log",
                f"13|REQUEUE_HOLD|smoke_t1:model.1|{LOGS}/slurm-model.1-13.log",
                "14|RUNNING|smoke_t1:model|/r/fa/smoke/t1/eval/logs/slurm-model-14.log") == [
        "10", "11", "12+0", "13", "14"]  # (an evaluation's: the same lock and keys)


def test_other_jobs_are_left_alone():
    assert _ids(f"20|RUNNING|smoke_t1:controller|{LOGS}/controller.log",  # (a live one)
                "21|RUNNING|smoke_t1:model|/r/fb/smoke/t1/logs/slurm-model-21.log",
                f"22|RUNNING|smoke_t10:model|{LOGS}/slurm-model-22.log",
                "23|RUNNING|smoke_t1:model|logs/slurm-model-23.log",
                f"24|COMPLETED|smoke_t1:model|{LOGS}/slurm-model-24.log",
                f"25|COMPLETING|smoke_t1:model|{LOGS}/slurm-model-25.log",  # ending already
                f"26|RUNNING|other|{LOGS}/slurm-model-26.log") == []


def test_percent_in_the_file_root():
    logs = "/r/50%/smoke/t1/logs"  # Slurm 22.05 shows the pattern: % doubled
    assert _ids("30|RUNNING|smoke_t1:model|/r/50%%/smoke/t1/logs/slurm-model-%%j.log",
                f"31|RUNNING|smoke_t1:model|{logs}/slurm-model-31.log", logs=logs) == ["30", "31"]
