"""Registration that knows about the queue (pure, fake clock)."""
from __future__ import annotations

from scheduler.jobs import JobState, JobStatus
from system.launcher.queue_wait import StartClock, blocked_failure


def status(job: str, state: JobState, workers: tuple[str, ...], reason: str = "",
           blocked: str = "") -> JobStatus:
    return JobStatus(job, state, workers, tuple(f"/l/{w}" for w in workers), "", 0, reason,
                     blocked)


def test_register_timeout_starts_when_the_job_runs():
    now = [0.0]
    clock = StartClock(lambda: now[0])
    expected = {"model/0", "model/1", "master/0"}
    pending = [status("1", JobState.PENDING, ("model/0", "model/1"), "Resources"),
               status("2", JobState.RUNNING, ("master/0",))]
    news = clock.update(pending, expected)
    assert news == ["waiting in the queue: the model group's job 1 is pending "
                    "(reason Resources)"]
    assert clock.pending_text() == "model Resources"
    now[0] = 500.0  # queued for 500 s: only the running job's worker is overdue
    assert clock.update(pending, expected) == []  # said once
    assert clock.overdue(expected, 120) == ["master/0"]
    clock.update([status("1", JobState.RUNNING, ("model/0", "model/1"))], expected)
    assert clock.pending_text() == ""
    now[0] = 600.0
    assert clock.overdue({"model/0"}, 120) == []
    now[0] = 621.0
    assert clock.overdue({"model/0"}, 120) == ["model/0"]


def test_a_new_reason_is_said_again_and_blocked_jobs_fail():
    clock = StartClock(lambda: 0.0)
    clock.update([status("1", JobState.PENDING, ("rollout/0",), "Priority")], {"rollout/0"})
    (news,) = clock.update([status("1", JobState.PENDING, ("rollout/0",), "Resources")],
                           {"rollout/0"})
    assert "Resources" in news
    assert clock.update([status("2", JobState.PENDING, ("master/0",))], {"master/0"}) == []
    assert clock.pending_text() == "master pending"  # no reason yet: shown, not said
    line = "the rollout group can never start: job 1 is pending with reason InvalidQOS"
    failure = blocked_failure([status("1", JobState.PENDING, ("rollout/0",), "InvalidQOS",
                                      line)])
    assert str(failure) == line and failure.worker == "rollout/0"
    assert failure.config  # never recovered: a new job would be blocked the same way
    assert blocked_failure([status("1", JobState.PENDING, ("rollout/0",), "Resources")]) is None
