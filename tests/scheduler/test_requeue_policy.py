"""The requeue/rejoin policy against a fake clock and fake job statuses (no Slurm)."""
from __future__ import annotations

from scheduler.jobs import JobState, JobStatus
from scheduler.requeue import RequeuePolicy, Restart
from scheduler.slurm import SlurmScheduler
from scheduler.slurm_config import SlurmConfig
from scheduler.local import LocalScheduler

WORKERS = ("rollout/0", "rollout/1")


class Clock:
    """A clock that only moves when the policy sleeps (or a test advances it)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def status(state: JobState, restarts: int = 0, job: str = "7") -> JobStatus:
    return JobStatus(job, state, WORKERS, ("a.log", "b.log"), restarts=restarts)


def feed(*statuses: list[JobStatus]):
    """A poll function answering each of ``statuses`` in turn, then the last forever."""
    answers = list(statuses)
    calls = []

    def poll() -> list[JobStatus]:
        calls.append(1)
        return answers.pop(0) if len(answers) > 1 else answers[0]
    poll.calls = calls  # type: ignore[attr-defined]
    return poll


def policy(clock: Clock, requeue: bool = True) -> RequeuePolicy:
    return RequeuePolicy(requeue=requeue, rejoin_timeout=60.0, requeue_grace=3.0, clock=clock,
                         sleep=clock.sleep)


def test_settle_asks_again_until_an_ended_looking_job_is_active():
    clock = Clock()
    poll = feed([status(JobState.CANCELLED)], [status(JobState.PENDING, restarts=1)])
    settled = policy(clock).settle([status(JobState.FAILED)], poll)
    assert [s.state for s in settled] == [JobState.PENDING]
    assert clock.slept == [0.5, 0.5]


def test_settle_gives_up_after_five_seconds_and_returns_the_last_answer():
    clock = Clock()
    poll = feed([status(JobState.FAILED)])
    settled = policy(clock).settle([status(JobState.FAILED)], poll)
    assert settled[0].state == JobState.FAILED
    assert 100.0 + 5.0 <= clock.now <= 100.0 + 5.5 and len(poll.calls) == len(clock.slept)


def test_without_requeue_nothing_is_settled_or_waited_for():
    clock = Clock()
    poll = feed([status(JobState.PENDING, restarts=1)])
    p = policy(clock, requeue=False)
    ended = [status(JobState.FAILED)]
    assert p.settle(ended, poll) is ended
    assert p.wait_requeued("rollout/0", poll, lambda r: None) is False
    assert poll.calls == [] and clock.slept == []


def test_a_restart_makes_its_workers_rejoin_once():
    clock = Clock()
    p = policy(clock)
    assert p.note([status(JobState.RUNNING)]) == []
    st = status(JobState.PENDING, restarts=1)
    assert p.note([st]) == [Restart(st, WORKERS)]
    assert p.restarts == {"7": 1} and p.rejoining == {w: 160.0 for w in WORKERS}
    assert p.note([st]) == []  # the same restart is noted once
    clock.now += 10
    st2 = status(JobState.RUNNING, restarts=2)
    assert p.note([st2]) == [Restart(st2, WORKERS)]
    assert p.rejoining == {w: 170.0 for w in WORKERS}  # a new restart renews the deadline


def test_a_worker_configured_in_the_new_incarnation_is_not_waited_for():
    p = policy(Clock())
    p.configured("rollout/0", 1)  # answered configure from its restarted job already
    st = status(JobState.RUNNING, restarts=1)
    assert p.note([st]) == [Restart(st, ("rollout/1",))]
    assert list(p.rejoining) == ["rollout/1"]


def test_moved_workers_rejoin_and_overdue_ones_are_named():
    clock = Clock()
    p = policy(clock)
    p.moved(["rollout/0"])
    clock.now += 30
    p.moved(["rollout/0", "rollout/1"])  # an earlier deadline is kept
    assert p.rejoining == {"rollout/0": 160.0, "rollout/1": 190.0}
    clock.now += 31
    assert p.overdue(back=[]) == ["rollout/0"]
    assert p.overdue(back=["rollout/0"]) == []
    p.rejoined(["rollout/0"])
    clock.now += 30
    assert p.overdue(back=[]) == ["rollout/1"]


def test_time_in_the_queue_does_not_count_toward_rejoining():
    """A requeued job pending (a partition down, no free nodes) failed its worker once
    ``rejoin_timeout`` had passed, the wait named nowhere: the clock starts when it runs."""
    clock = Clock()
    p = policy(clock)
    p.moved(["rollout/0", "rollout/1"])
    for _ in range(10):  # ten minutes in the queue
        clock.now += 61
        p.queued(["rollout/0", "model/0"])  # (model/0 is not rejoining: ignored)
        assert p.overdue(back=[]) == ["rollout/1"]
    assert "model/0" not in p.rejoining
    clock.now += 59  # it runs now: the full timeout from its last sight in the queue
    assert p.overdue(back=[]) == ["rollout/1"]
    clock.now += 2
    assert p.overdue(back=[]) == ["rollout/0", "rollout/1"]


def test_wait_requeued_polls_until_the_restart_shows():
    clock = Clock()
    p = policy(clock)
    noted: list[Restart] = []
    poll = feed([status(JobState.RUNNING)], [status(JobState.RUNNING)],
                [status(JobState.PENDING, restarts=1)])
    assert p.wait_requeued("rollout/1", poll, noted.extend) is True
    assert [r.job.restarts for r in noted] == [1] and clock.slept == [0.5, 0.5]


def test_wait_requeued_gives_up_after_the_grace():
    clock = Clock()
    p = policy(clock)
    assert p.wait_requeued("rollout/1", feed([status(JobState.RUNNING)]), lambda r: None) is False
    assert 103.0 < clock.now <= 103.5


def test_schedulers_expose_their_policy_and_python(tmp_path):
    import sys

    local = LocalScheduler()
    assert local.python == sys.executable and local.requeue_policy().requeue is False
    slurm = SlurmScheduler(SlurmConfig(python="/opt/py", rejoin_timeout=12.0, requeue_grace=4.0),
                           "e", "t", str(tmp_path), str(tmp_path))
    p = slurm.requeue_policy()
    assert slurm.python == "/opt/py"
    assert (p.requeue, p.rejoin_timeout, p.requeue_grace) == (True, 12.0, 4.0)
    off = SlurmScheduler(SlurmConfig(requeue=False), "e", "t", str(tmp_path), str(tmp_path))
    assert off.python == sys.executable and off.requeue_policy().requeue is False


def test_hetjob_waits_for_the_whole_job_to_requeue(tmp_path):
    """Under hetjob the job requeues once every group stopped (the stateful ones after the
    checkpoint): a preempted group that stopped first is waited for up to signal_seconds."""
    het = SlurmScheduler(SlurmConfig(hetjob=True, requeue_grace=4.0, signal_seconds=120), "e",
                         "t", str(tmp_path), str(tmp_path))
    assert het.requeue_policy().requeue_grace == 120
    plain = SlurmScheduler(SlurmConfig(requeue_grace=4.0), "e", "t", str(tmp_path),
                           str(tmp_path))
    assert plain.requeue_policy().requeue_grace == 4.0
