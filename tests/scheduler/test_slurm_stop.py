"""Stopping a Slurm trial leaves nothing in the queue: pending jobs (which take no signal) as well
as running ones, and a slurmctld that does not answer ``scancel`` at first. On the real test
Slurm."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from scheduler.base import GroupSpec, JobState
from scheduler.slurm import SlurmScheduler
from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from tests.helpers import REPO, read_summary, run_launch
from tests.scheduler import slurm_shims
from tests.scheduler.slurm_shims import requeue_setting
from tests.scheduler.test_slurm_e2e import SLURM, squeue, wait_for

pytestmark = pytest.mark.slurm

BEGIN_LATER = "--begin=now+600"  # holds a job pending for ten minutes


def _queue(env: dict, ids: list[str]) -> list[str]:
    """Lines squeue prints for ``ids`` (empty: none of them is queued any more)."""
    r = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T"], capture_output=True,
                       text=True, env={**os.environ, **env})
    return r.stdout.split()


def _jobs_named(name: str) -> list[str]:
    """Ids of the queued jobs named ``name``."""
    r = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True)
    return r.stdout.split()


def _wait_none_completing() -> None:
    """Until no job is completing: one (an earlier test's, just cancelled) whose end a stopped
    slurmctld misses drains the node ("Kill task failed"), and no later job starts."""
    def completing() -> list[str]:
        r = subprocess.run(["squeue", "-h", "-t", "COMPLETING", "-o", "%i"],
                           capture_output=True, text=True)
        return r.stdout.split()
    wait_for(lambda: not completing(), 60, "no job completing")


def _scheduler(tmp_path, name: str) -> tuple[SlurmScheduler, list[str]]:
    """A running master job (a sleeping task) and a rollout job held pending."""
    slurm = SlurmConfig(poll_interval=0.2,
                        rollout=SlurmGroupConfig(extra_sbatch=[BEGIN_LATER]))
    sched = SlurmScheduler(slurm, "stop", name, str(tmp_path), REPO)
    ids = []
    for kind in ("master", "rollout"):
        group = GroupSpec(kind, 1, ("sleep", "300"), {}, (str(tmp_path / f"{kind}.log"),))
        ids += sched.schedule(sched.plan(group))
    return sched, ids


def _wait_running_and_pending(sched: SlurmScheduler, ids: list[str]) -> None:
    states = lambda: {s.job_id: s.state for s in sched.poll(fresh=True)}  # noqa: E731
    wait_for(lambda: states() == {ids[0]: JobState.RUNNING, ids[1]: JobState.PENDING}, 60,
             "one job running and one pending")


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    return slurm_cluster.env


def test_stop_all_cancels_pending_and_running_jobs(slurm_env, tmp_path):
    sched, ids = _scheduler(tmp_path, "both")
    try:
        _wait_running_and_pending(sched, ids)
        t0 = time.monotonic()
        sched.stop_all(grace=3)
        assert _queue(slurm_env, ids) == []
        assert time.monotonic() - t0 < 30
    finally:
        subprocess.run(["scancel", *ids], env={**os.environ, **slurm_env})


def test_stop_all_outlasts_a_scancel_that_does_not_answer(slurm_env, tmp_path, monkeypatch):
    """The first scancel calls hang (a busy slurmctld); stopping retries until the queue is
    empty instead of raising."""
    sched, ids = _scheduler(tmp_path, "slow")
    shim = slurm_shims.shim(tmp_path, "scancel", 2, then="exec sleep 60")  # hangs
    try:
        _wait_running_and_pending(sched, ids)
        monkeypatch.setenv("PATH", f"{shim.bin_dir}:{os.environ['PATH']}")
        sched.scancel_timeout = 3.0  # (the real one may be slow on a loaded machine)
        sched.stop_all(grace=1)
        assert _queue(slurm_env, ids) == []
        assert shim.count() > 2
    finally:
        subprocess.run([shim.real, *ids], env={**os.environ, **slurm_env})


def test_failed_trial_with_a_pending_job_leaves_nothing(slurm_cluster, tmp_path):
    """The rollout job never starts (held pending): the queue timeout ends the trial (queue
    time does not count toward registration), and stopping it cancels the pending job with the
    running ones."""
    root = str(tmp_path / "runs")
    r = run_launch("exp=smoke", "trial=pend", f"cluster.fileroot={root}", *SLURM,
                   f'scheduler.slurm.rollout.extra_sbatch=["{BEGIN_LATER}"]',
                   "scheduler.slurm.queue_timeout=20", env=slurm_cluster.env, timeout=240)
    assert r.returncode == 1, r.stderr
    assert "the rollout group did not start" in r.stderr and "BeginTime" in r.stderr, r.stderr
    assert "error while stopping" not in r.stderr, r.stderr
    assert read_summary(root, "smoke", "pend")["status"] == "failed"
    assert squeue(slurm_cluster.env, "smoke", "pend") == []


def _running_job(sched: SlurmScheduler, group: GroupSpec) -> str:
    (job_id,) = sched.schedule(sched.plan(group))
    wait_for(lambda: [s.state for s in sched.poll(fresh=True)] == [JobState.RUNNING], 60,
             f"job {job_id} running")
    return job_id


def test_stop_worker_of_a_two_task_job(slurm_env, tmp_path):
    """One task of two is forgotten (Slurm cannot stop it alone) and its job may no longer be
    requeued; forgetting the other cancels the job."""
    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2), "stop", "w2", str(tmp_path), REPO)
    logs = (str(tmp_path / "rollout-0.log"), str(tmp_path / "rollout-1.log"))
    job_id = _running_job(sched, GroupSpec("rollout", 2, ("sleep", "300"), {}, logs))
    try:
        sched.stop_worker("rollout/1", grace=3)
        (st,) = sched.poll()
        assert (st.job_id, st.state, st.workers, st.log_paths) == (
            job_id, JobState.RUNNING, ("rollout/0",), logs[:1])
        assert _queue(slurm_env, [job_id]) == [f"{job_id}|RUNNING"]
        assert "Requeue=0" in subprocess.run(["scontrol", "show", "job", job_id],
                                             capture_output=True, text=True).stdout
        # should it requeue all the same, its copy of rollout/1 exits (scheduler/slurm_marks.py)
        assert [f for f in os.listdir(tmp_path) if f.startswith(".requeue")] == [
            f".requeue-rollout-{job_id}.forgotten-1"]
        sched.stop_worker("rollout/1", grace=3)  # already forgotten: nothing to do
        sched.stop_worker("rollout/0", grace=3)
        assert _queue(slurm_env, [job_id]) == [] and sched.poll() == []
    finally:
        subprocess.run(["scancel", job_id], env={**os.environ, **slurm_env})


def test_a_job_whose_requeue_slurm_could_not_turn_off_is_asked_again(slurm_env, tmp_path,
                                                                      monkeypatch, caplog):
    """One task of two is forgotten while Slurm's controller cannot be reached (its first
    ``scontrol update`` fails to connect, as while slurmctld restarts): ``Requeue=0`` is not
    taken, so a later requeue of the job would start that worker again beside its
    replacement. Once Slurm answers a poll, it is asked again, and takes it."""
    from scheduler import slurm_updates

    monkeypatch.setattr(slurm_updates, "RETRY_EVERY", 0.0)
    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2), "stop", "w2s", str(tmp_path), REPO)
    logs = (str(tmp_path / "rollout-0.log"), str(tmp_path / "rollout-1.log"))
    job_id = _running_job(sched, GroupSpec("rollout", 2, ("sleep", "300"), {}, logs))
    shim = slurm_shims.shim(tmp_path, "scontrol", 1, only="update")

    try:
        assert requeue_setting(job_id) == "Requeue=1"
        monkeypatch.setenv("PATH", f"{shim.bin_dir}:{os.environ['PATH']}")
        sched.stop_worker("rollout/1", grace=3)
        assert f"job {job_id} may still be requeued" in caplog.text
        assert requeue_setting(job_id) == "Requeue=1"
        wait_for(lambda: sched.poll(fresh=True) and requeue_setting(job_id) == "Requeue=0", 60,
                 "Requeue=0 taken")
        assert f"job {job_id} will no longer be requeued" in caplog.text
        assert sched._updates.unsettled == []
        (st,) = sched.poll(fresh=True)
        assert st.workers == ("rollout/0",)
        assert shim.count() == 2  # (not asked again once taken)
    finally:
        subprocess.run(["scancel", job_id], env={**os.environ, **slurm_env})


def test_stop_worker_of_a_one_task_job(slurm_env, tmp_path):
    """A worker restarted alone (rollout/3) is its own job: stopping it cancels the job and
    leaves the group's job alone."""
    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2), "stop", "w1", str(tmp_path), REPO)
    group = _running_job(sched, GroupSpec("rollout", 1, ("sleep", "300"), {},
                                          (str(tmp_path / "rollout-0.log"),)))
    one = GroupSpec("rollout", 1, ("sleep", "300"), {}, (str(tmp_path / "rollout-3.log"),), 3)
    (job_id,) = sched.schedule(sched.plan(one))
    try:
        wait_for(lambda: {s.job_id: s.state for s in sched.poll(fresh=True)}
                 == {group: JobState.RUNNING, job_id: JobState.RUNNING}, 60, "both running")
        t0 = time.monotonic()
        sched.stop_worker("rollout/3", grace=3)
        assert time.monotonic() - t0 < 30
        assert _queue(slurm_env, [job_id]) == []
        assert [(s.job_id, s.workers) for s in sched.poll()] == [(group, ("rollout/0",))]
    finally:
        subprocess.run(["scancel", group, job_id], env={**os.environ, **slurm_env})


def test_a_poll_while_slurmctld_does_not_answer_is_no_news(
        slurm_env, slurm_cluster, tmp_path, caplog):
    """An overloaded slurmctld (here: stopped) answers no ``squeue``: a poll raised after its
    time-out, which failed a healthy trial and then its clean-up with a traceback (no
    ``summary.json``, the trial shown lost). No news is no failure: the jobs' states are
    unknown (active), said once; the poll after it answers again says so."""
    import logging
    import signal

    sched, ids = _scheduler(tmp_path, "silent")
    with open(os.path.join(slurm_cluster.root, "slurmctld.pid")) as f:
        pid = int(f.read())
    try:
        _wait_running_and_pending(sched, ids)
        _wait_none_completing()
        with caplog.at_level(logging.WARNING, logger="slurm"):
            os.kill(pid, signal.SIGSTOP)
            try:
                silent = []
                for timeout in (0.5, 30.0):  # squeue timed out; then it said it cannot connect
                    sched.query_timeout = timeout
                    silent.append(sched.poll(fresh=True))
            finally:
                os.kill(pid, signal.SIGCONT)
            assert [{s.job_id: s.state for s in got} for got in silent] == [
                {ids[0]: JobState.UNKNOWN, ids[1]: JobState.UNKNOWN}] * 2  # (active: no news)
            assert caplog.text.count("Slurm's controller does not answer") == 1, caplog.text
            assert "did not answer within" in caplog.text  # (the time-out: it raised)
            # real states again: the pending job as it was (the running one, as Slurm says: a
            # loaded machine's slurmctld, stopped, may have judged its node lost meanwhile)
            def known_again() -> dict[str, JobState]:
                got = {s.job_id: s.state for s in sched.poll(fresh=True)}
                return {} if JobState.UNKNOWN in got.values() else got

            answered = wait_for(known_again, 60, "an answer again")
            assert answered[ids[1]] == JobState.PENDING, answered
            assert "Slurm's controller answers again" in caplog.text
    finally:
        subprocess.run(["scancel", *ids], env={**os.environ, **slurm_env})


def test_a_job_that_an_unanswered_sbatch_queued_all_the_same_is_taken(slurm_env, slurm_cluster,
                                                                       tmp_path):
    """slurmctld stalls (here: stopped) while sbatch submits: sbatch gives up ("Socket timed
    out"), but Slurm queues the job once it answers. The job ran untracked (until its workers
    judged their controller gone) and the submission failed; a recovery that went on would
    have submitted the group again beside it. Now the queue is searched for it and it is
    taken as the submitted job."""
    import signal
    import threading

    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2), "stall", "t", str(tmp_path), REPO)
    group = GroupSpec("master", 1, ("sleep", "300"), {}, (str(tmp_path / "master.log"),))
    request = sched.plan(group)
    with open(os.path.join(slurm_cluster.root, "slurmctld.pid")) as f:
        pid = int(f.read())

    def resume_once_sbatch_gave_up() -> None:
        seen, deadline = False, time.monotonic() + 60
        while time.monotonic() < deadline:
            running = subprocess.run(["pgrep", "-f", f"sbatch --parsable {request.script_path}"],
                                     capture_output=True).returncode == 0
            if seen and not running:
                break
            seen = seen or running
            time.sleep(0.1)
        os.kill(pid, signal.SIGCONT)

    resume = threading.Thread(target=resume_once_sbatch_gave_up)
    _wait_none_completing()
    os.kill(pid, signal.SIGSTOP)
    resume.start()
    ids: list[str] = []
    try:
        ids = sched.schedule(request)
        resume.join()
        assert len(ids) == 1
        assert _queue(slurm_env, ids) in ([f"{ids[0]}|RUNNING"], [f"{ids[0]}|PENDING"])
        r = subprocess.run(["squeue", "-h", "-n", "stall_t:master", "-o", "%i"],
                           capture_output=True, text=True)
        assert r.stdout.split() == ids  # one job, the one tracked
    finally:
        os.kill(pid, signal.SIGCONT)
        resume.join()
        r = subprocess.run(["squeue", "-h", "-n", "stall_t:master", "-o", "%i"],
                           capture_output=True, text=True)
        subprocess.run(["scancel", *r.stdout.split()])


def test_a_job_an_unanswered_sbatch_queued_after_adoption_gave_up_is_taken_next_time(
        slurm_env, slurm_cluster, tmp_path, monkeypatch):
    """slurmctld stalls (here: stopped) through sbatch's time-out and the queue search after it
    (cut to nothing): the submission fails unconfirmed, its job's name remembered; twice (a
    recovery's retry). Slurm then queues both jobs all the same; the group's next submission
    takes one instead of submitting a third beside them, and cancels the other copy."""
    import signal

    from scheduler import slurm_submit
    from scheduler.slurm_submit import SubmitUnconfirmed

    monkeypatch.setattr(slurm_submit, "ADOPT_WAIT", 0.0)  # (one look, while still stalled)
    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2), "stall2", "t", str(tmp_path), REPO)
    group = GroupSpec("master", 1, ("sleep", "300"), {}, (str(tmp_path / "master.log"),))
    request = sched.plan(group)
    name = "stall2_t:master"
    with open(os.path.join(slurm_cluster.root, "slurmctld.pid")) as f:
        pid = int(f.read())

    def queued() -> list[str]:
        return _jobs_named(name)

    _wait_none_completing()
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(2):
            with pytest.raises(SubmitUnconfirmed):
                sched.schedule(request)
            assert sched._submitter.unconfirmed == {name}
        os.kill(pid, signal.SIGCONT)
        both = wait_for(lambda: len(queued()) == 2 and sorted(queued(), key=int), 60,
                        f"Slurm queuing both jobs of {name} all the same")
        ids = sched.schedule(request)
        assert len(ids) == 1 and ids[0] in both  # one queued job taken, not sbatch'ed again
        (other,) = set(both) - set(ids)  # (the newest, or the one already running)
        wait_for(lambda: queued() == ids, 60, f"the other copy, {other}, cancelled")
        assert sched._submitter.unconfirmed == set()
        assert [s.job_id for s in sched.poll(fresh=True)] == ids  # and tracked
    finally:
        os.kill(pid, signal.SIGCONT)
        subprocess.run(["scancel", *queued()])


def test_a_late_copy_of_an_unanswered_sbatch_is_cancelled_after_the_next_one(
        slurm_env, slurm_cluster, tmp_path, monkeypatch):
    """The submission after an unconfirmed one looks for its job first, but the queue does not
    answer (its squeue fails): it submits, and the earlier job, queued meanwhile, ran on
    untracked beside the new one. Once Slurm answers, it is found and cancelled."""
    import signal

    from scheduler import slurm_submit
    from scheduler.slurm_submit import SubmitUnconfirmed

    monkeypatch.setattr(slurm_submit, "ADOPT_WAIT", 0.0)
    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2), "stall3", "t", str(tmp_path), REPO)
    request = sched.plan(GroupSpec("master", 1, ("sleep", "300"), {},
                                   (str(tmp_path / "master.log"),)))
    name = "stall3_t:master"
    with open(os.path.join(slurm_cluster.root, "slurmctld.pid")) as f:
        pid = int(f.read())

    def queued() -> list[str]:
        return _jobs_named(name)

    shim = slurm_shims.shim(tmp_path, "squeue", 1)  # its first answer after the stall: none
    _wait_none_completing()
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(SubmitUnconfirmed):
            sched.schedule(request)
        os.kill(pid, signal.SIGCONT)
        (late,) = wait_for(queued, 60, f"Slurm queuing {name} all the same")
        monkeypatch.setenv("PATH", f"{shim.bin_dir}:{os.environ['PATH']}")
        ids = sched.schedule(request)
        assert shim.count() >= 2  # the look before sbatch failed, then after
        assert ids != [late]
        wait_for(lambda: queued() == ids, 60, f"the late copy, {late}, cancelled")
        assert sched._submitter.unconfirmed == set()
    finally:
        os.kill(pid, signal.SIGCONT)
        subprocess.run(["scancel", *queued()])


def test_a_requeued_job_whose_time_limit_is_too_short_fails_in_one_line(slurm_env, tmp_path):
    """A time limit below 2 x signal_seconds + 60 s set on the job after submission (or the
    partition's DefaultTime, for a group without a limit of its own): SIGUSR2 at once, a
    requeue, again, every 30 s, each "not a failure", for good. The requeued job is judged
    blocked, naming its time limit and what to change."""
    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2), "short", "t", str(tmp_path), REPO)
    job = _running_job(sched, GroupSpec("rollout", 1, ("sleep", "300"), {},
                                        (str(tmp_path / "rollout-0.log"),)))
    try:
        (st,) = sched.poll(fresh=True)
        assert st.blocked == ""  # (no limit of its own: the partition's, unlimited here)
        env = {**os.environ, **slurm_env}
        subprocess.run(["scontrol", "update", f"jobid={job}", "TimeLimit=2"], env=env,
                       check=True)
        subprocess.run(["scontrol", "requeue", job], env=env, check=True)
        wait_for(lambda: sched.poll(fresh=True)[0].restarts == 1, 60, "the requeue")
        (st,) = sched.poll(fresh=True)
        assert st.blocked == (
            f"job {job} of the rollout group was requeued with a time limit of 120 s (Slurm's "
            "TimeLimit=00:02:00: set on the job, or the partition's DefaultTime), too short for "
            "scheduler.slurm.signal_seconds=120: SIGUSR2 stops it at once and it requeues over "
            "and over; valid: a time limit of at least 300 s (scheduler.slurm.rollout.time or "
            "scheduler.slurm.time), a smaller signal_seconds, or scheduler.slurm.requeue=false")
    finally:
        subprocess.run(["scancel", job], env={**os.environ, **slurm_env})
