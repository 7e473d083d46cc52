"""One worker of a group stopped and started again alone: the local scheduler end to end (real
processes), the worker index a Slurm task derives (``RLSYS_WORKER_BASE``), the group specs."""
from __future__ import annotations

import os
import time

import pytest

from scheduler.base import GroupSpec, JobState
from scheduler.local import LocalScheduler
from system.launcher.groups import group_spec
from system.launcher.run_worker import task_identity
from system.paths import TrialPaths

# prints the index it was given both ways, then sleeps (``--index N`` lands in "$@")
ECHO_AND_SLEEP = ("sh", "-c", 'echo "$RLSYS_WORKER_INDEX $2"; exec sleep 300', "worker")


def _group(tmp_path, count: int, first: int = 0) -> GroupSpec:
    return GroupSpec("rollout", count, ECHO_AND_SLEEP, {},
                     tuple(str(tmp_path / f"rollout-{first + i}.log") for i in range(count)), first)


def _running(sched: LocalScheduler) -> dict[str, str]:
    """Worker -> job id (pid) of every job the scheduler lists as running."""
    return {st.workers[0]: st.job_id for st in sched.poll() if st.state == JobState.RUNNING}


def _gone(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    return False


def _wait_logged(path, text: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read() == text:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never read {text!r}")


def test_local_stop_worker_restarts_one_worker_alone(tmp_path):
    sched = LocalScheduler()
    try:
        ids = sched.submit(_group(tmp_path, 3))
        assert list(_running(sched)) == ["rollout/0", "rollout/1", "rollout/2"]
        sched.stop_worker("rollout/1", grace=2)
        assert _gone(ids[1])
        assert _running(sched) == {"rollout/0": ids[0], "rollout/2": ids[2]}
        sched.stop_worker("rollout/1", grace=2)  # already forgotten: nothing to do

        one = _group(tmp_path / "again", 1, first=1)
        assert one.worker_names() == ("rollout/1",)
        (new,) = sched.submit(one)
        _wait_logged(one.log_paths[0], "1 1\n")
        statuses = {st.workers[0]: st for st in sched.poll()}
        assert sorted(statuses) == ["rollout/0", "rollout/1", "rollout/2"]
        assert statuses["rollout/1"].job_id == new
        assert statuses["rollout/1"].log_paths == one.log_paths
        assert all(st.state == JobState.RUNNING for st in statuses.values())
    finally:
        sched.stop_all(grace=2)
    assert all(_gone(pid) for pid in [*ids, new])


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


def test_a_worker_whose_job_is_marked_for_a_requeue_is_preempted(tmp_path):
    """A worker that got SIGUSR2 marks its job (the file its script checks once srun returns):
    the Slurm scheduler reports the worker as stopping for a requeue, until the mark is gone;
    workers of other jobs, and schedulers without requeues, never."""
    from scheduler.slurm import SlurmScheduler
    from scheduler.slurm_config import SlurmConfig
    from scheduler.slurm_marks import requeue_mark_prefix

    paths = TrialPaths(str(tmp_path))
    os.makedirs(paths.logs)
    slurm = SlurmScheduler(SlurmConfig(), "e", "t", str(tmp_path), str(tmp_path))
    gen, roll = group_spec("generation", 2, paths, "py"), group_spec("rollout", 2, paths, "py")
    slurm._jobs.update({"41": gen, "42": roll})  # as schedule() records them
    mark = requeue_mark_prefix(paths.logs, "generation") + "41"
    assert not slurm.preempted("generation/1")
    open(mark, "w").close()
    assert slurm.preempted("generation/0") and slurm.preempted("generation/1")
    assert not slurm.preempted("rollout/0")
    os.remove(mark)
    assert not slurm.preempted("generation/1")
    assert not LocalScheduler().preempted("generation/1")


def test_a_copy_of_a_worker_restarted_elsewhere_exits_when_its_old_job_requeues(tmp_path):
    """rollout/1 was restarted in a job of its own while job 77 ran on with rollout/0; job 77
    requeued all the same (Slurm had not taken ``Requeue=0``) and starts both tasks again. The
    real worker entry point, as task 1 of job 77: it finds rollout/1's mark and exits 0 before
    it registers (its registration would be over its replacement's name), while task 0 of the
    same job goes on (here: to read its trial's files, absent, and fail on them)."""
    import subprocess
    import sys

    from scheduler.slurm_marks import forgotten_mark, requeue_mark_prefix
    from tests.helpers import REPO

    mark = requeue_mark_prefix(str(tmp_path), "rollout") + "77"
    open(forgotten_mark(mark, 1), "w").close()
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "RLSYS_REQUEUE_MARK": mark}
    env.pop("RLSYS_WORKER_BASE", None)

    def task(rank: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "system.launcher.run_worker", "--trial-dir",
                               str(tmp_path / "trial"), "--kind", "rollout"], cwd=REPO,
                              env={**env, "SLURM_PROCID": str(rank)}, capture_output=True,
                              text=True, timeout=120)
    copy = task(1)
    assert copy.returncode == 0, copy.stderr
    assert (f"rollout/1 was restarted elsewhere while job 77 ran on ({forgotten_mark(mark, 1)}): "
            "this copy exits") in copy.stderr
    other = task(0)
    assert other.returncode != 0 and "bootstrap.json" in other.stderr, other.stderr


def test_a_job_just_submitted_has_no_marks_of_workers_restarted_elsewhere(tmp_path):
    """Marks of an earlier job that Slurm numbered alike (its job ids started over: its state
    lost) are not the new job's: they go as it is recorded; another job's stay."""
    from scheduler.slurm import SlurmScheduler
    from scheduler.slurm_config import SlurmConfig
    from scheduler.slurm_marks import forgotten_mark, requeue_mark_prefix

    paths = TrialPaths(str(tmp_path / "it's [a] trial"))  # (glob's own characters in the path)
    os.makedirs(paths.logs)
    slurm = SlurmScheduler(SlurmConfig(), "e", "t", paths.root, str(tmp_path))
    prefix = requeue_mark_prefix(paths.logs, "rollout")
    stale, other = forgotten_mark(prefix + "7", 1), forgotten_mark(prefix + "77", 1)
    for path in (stale, other, prefix + "7"):
        open(path, "w").close()
    slurm._record(slurm.plan(group_spec("rollout", 2, paths, "py")), "7")  # as schedule() does
    assert not os.path.exists(stale) and os.path.exists(other)
    assert os.path.exists(prefix + "7")  # (its requeue mark: its script's to remove)
    slurm._mark_forgotten("7", ["rollout/1"])  # (stop_worker, as the job runs on)
    assert os.path.exists(stale)
    off = SlurmScheduler(SlurmConfig(requeue=False), "e", "t", paths.root, str(tmp_path))
    off._jobs["8"] = slurm._jobs["7"]
    off._mark_forgotten("8", ["rollout/1"])  # (no requeue: no copy can start again)
    assert not os.path.exists(forgotten_mark(prefix + "8", 1))
