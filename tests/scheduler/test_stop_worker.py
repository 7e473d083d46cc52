"""Groups of workers ``first..first+count-1``: the group specs, the local scheduler's plan, the
worker index a Slurm task derives (``RLSYS_WORKER_BASE``)."""
from __future__ import annotations

import pytest

from scheduler.base import GroupSpec
from scheduler.local import LocalScheduler
from system.launcher.groups import group_spec
from system.launcher.run_worker import task_identity
from system.paths import TrialPaths

# prints the index it was given both ways, then sleeps (``--index N`` lands in "$@")
ECHO_AND_SLEEP = ("sh", "-c", 'echo "$RLSYS_WORKER_INDEX $2"; exec sleep 300', "worker")


def _group(tmp_path, count: int, first: int = 0) -> GroupSpec:
    return GroupSpec("rollout", count, ECHO_AND_SLEEP, {},
                     tuple(str(tmp_path / f"rollout-{first + i}.log") for i in range(count)), first)


def test_local_plan_indexes_from_first(tmp_path):
    request = LocalScheduler().plan(_group(tmp_path, 2, first=0))
    assert [p.argv[-1] for p in request.processes] == ["0", "1"]
    request = LocalScheduler().plan(_group(tmp_path, 1, first=4))
    (proc,) = request.processes
    assert proc.name == "rollout/4" and proc.argv[-2:] == ("--index", "4")
    assert proc.env["RLSYS_WORKER_INDEX"] == "4" and proc.log_path.endswith("rollout-4.log")


def test_group_spec_first_and_attempt():
    paths = TrialPaths("/t")
    one = group_spec("generation", 1, paths, "py", attempt=2, first=3)
    assert one.first == 3 and one.worker_names() == ("generation/3",)
    assert one.log_paths == ("/t/logs/generation-3.attempt2.log",)
    whole = group_spec("generation", 2, paths, "py")
    assert whole.worker_names() == ("generation/0", "generation/1")
    assert whole.log_paths == ("/t/logs/generation-0.log", "/t/logs/generation-1.log")
    with pytest.raises(ValueError):
        GroupSpec("generation", 2, ("py",), {}, ("/only-one.log",))


@pytest.fixture
def slurm_task(monkeypatch):
    """The SLURM_* variables of task 1 (local rank 1) of a two-task job, as srun sets them."""
    for k, v in {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                 "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RLSYS_WORKER_BASE", raising=False)
    return monkeypatch


def test_task_identity_adds_the_worker_base(slurm_task):
    assert task_identity(None) == (1, 1)
    slurm_task.setenv("RLSYS_WORKER_BASE", "3")
    assert task_identity(None) == (4, 1)
    assert task_identity(5) == (5, 0)  # an explicit index (local scheduler) wins


def test_task_identity_outside_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("RLSYS_WORKER_BASE", "3")  # only Slurm tasks add it
    monkeypatch.setenv("RLSYS_WORKER_INDEX", "2")
    assert task_identity(None) == (2, 0)
