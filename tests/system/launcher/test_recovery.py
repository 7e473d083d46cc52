"""Automatic recovery's bookkeeping: what a failure restarts, back-off, the attempts recorded."""
from __future__ import annotations

from system.errors import WorkerFailure
from system.launcher.config import RecoverConfig
from system.launcher.recovery import MasterProgress, Paused, Recovery

ORDER = ("model", "generation", "rollout", "master")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_stateful_death_restarts_every_stateful_kind_a_stateless_one_only_itself():
    r = Recovery(RecoverConfig(), ("model", "master"), t0=0.0)
    for worker in ("model/1", "master/0"):
        assert r.restarts_stateful(WorkerFailure("x", worker))
        assert r.kinds_to_restart(WorkerFailure("x", worker), ORDER) == ("model", "master")
    # generation servers and rollout workers restart alone; training goes on
    assert not r.restarts_stateful(WorkerFailure("x", "rollout/3"))
    assert not r.restarts_stateful(WorkerFailure("x", "generation/0"))
    # a failure that interrupts a restart restarts the unfinished kinds too
    r.incomplete = {"rollout"}
    assert r.restarts_stateful(WorkerFailure("x", "generation/0"))
    assert r.kinds_to_restart(WorkerFailure("x", "master/0"), ORDER) == (
        "model", "rollout", "master")


def test_a_stateless_restart_loses_no_step_and_has_its_own_retries():
    clock = Clock()
    r = Recovery(RecoverConfig(retries=2), ("model", "master"), t0=990.0, clock=clock)
    gen = WorkerFailure("worker generation/0 stopped heart-beating", "generation/0")
    r.begin(WorkerFailure("x", "master/0"), failed_step=9)
    r.resumed(0)  # the start's own report, before any stateless attempt
    for _ in range(2):
        assert r.should_recover(gen)
        r.begin(gen, failed_step=12, restarted=["generation/0"])
        r.resumed(99)  # the master did not restart: no stateless attempt takes it
        clock.t += 5
        r.running(["generation/0"])
    assert not r.should_recover(gen)  # its retries are used up
    assert r.should_recover(WorkerFailure("x", "rollout/1"))  # another worker's are not
    assert r.should_recover(WorkerFailure("x", "model/0"))    # nor the stateful restarts'
    last = r.summary()[-1]
    assert last["steps_lost"] == 0 and last["stateful"] is False
    assert last["restarted"] == ["generation/0"] and last["recovered_at_s"] == 20.0
    assert last["resumed_from"] is None and r.summary()[0]["resumed_from"] == 0


def test_retries_backoff_and_attempts():
    clock = Clock()
    r = Recovery(RecoverConfig(retries=2, backoff=3.0), ("model", "master"), t0=990.0,
                 clock=clock)
    failure = WorkerFailure("worker master/0 raised RuntimeError: boom\ntraceback...", "master/0")
    assert r.should_recover(failure)
    a = r.begin(failure, failed_step=7)
    assert a.cause == "worker master/0 raised RuntimeError: boom" and a.failed_at_s == 10.0
    assert r.backoff() == 0.0  # the first failure: at once
    clock.t += 20
    r.running()
    r.resumed(6)
    r.resumed(99)  # only the first report counts
    assert r.summary() == [{"attempt": 1, "cause": a.cause, "worker": "master/0",
                            "failed_at_s": 10.0, "failed_step": 7, "resumed_from": 6,
                            "recovered_at_s": 30.0, "restarted": [], "stateful": True, "also": [],
                            "requeued": False, "paused": False,
                            "steps_lost": 1}]
    clock.t += 30  # fails again 30 s after running: a crash loop
    r.begin(failure, failed_step=None)
    assert r.backoff() == 3.0  # a crash loop: the back-off
    assert not r.should_recover(failure)  # retries used up
    assert r.summary()[1]["steps_lost"] is None


def test_off_resume_and_experiments_without_state_never_recover():
    failure = WorkerFailure("x", "model/0")
    assert not Recovery(RecoverConfig(type="off"), ("model",), 0.0).should_recover(failure)
    assert not Recovery(RecoverConfig(type="resume"), ("model",), 0.0).should_recover(failure)
    assert not Recovery(None, ("model",), 0.0).should_recover(failure)
    assert not Recovery(RecoverConfig(), (), 0.0).should_recover(failure)  # smoke
    assert not Recovery(RecoverConfig(), ("model",), 0.0).should_recover(WorkerFailure("t"))


def test_master_progress_follows_steps_and_stalls():
    p = MasterProgress()
    p.update({"phase": "starting", "resumed_from": 4})
    assert p.resumed_from == 4 and p.last_step is None
    p.update({"step": "12/160", "reward": "0.5"})
    assert p.last_step == 12 and p.unchanged_for() < 1
    p.changed_at -= 100
    p.update({"step": "12/160", "reward": "0.5"})  # the same progress: still unchanged
    assert p.unchanged_for() >= 100
    p.restarted()
    assert p.resumed_from is None and p.unchanged_for() < 1


def test_independent_failures_far_apart_restart_at_once_a_crash_loop_backs_off():
    clock = Clock()
    r = Recovery(RecoverConfig(retries=5, backoff=2.0), ("model", "master"), t0=1000.0,
                 clock=clock)
    failure = WorkerFailure("x", "model/0")
    for _ in range(3):
        clock.t += 120  # each fault two minutes after the last recovery
        r.begin(failure, failed_step=1)
        assert r.backoff() == 0.0
        clock.t += 10
        r.running()
    clock.t += 5  # now one right after: 2 s, then 4 s
    r.begin(failure, failed_step=1)
    assert r.backoff() == 2.0
    r.running()
    clock.t += 1
    r.begin(failure, failed_step=1)
    assert r.backoff() == 4.0


def test_a_failure_after_progress_past_the_last_one_is_no_crash_loop():
    clock = Clock()
    r = Recovery(RecoverConfig(retries=5, backoff=2.0), ("model", "master"), t0=1000.0,
                 clock=clock)
    r.begin(WorkerFailure("x", "model/0"), failed_step=90)
    r.running()
    clock.t += 9  # soon, but at step 120: the trial went on past step 90
    r.begin(WorkerFailure("y", "master/0"), failed_step=120)
    assert r.backoff() == 0.0
    r.running()
    clock.t += 3  # again at step 120 (or unknown): the same fault again
    r.begin(WorkerFailure("y", "master/0"), failed_step=120)
    assert r.backoff() == 2.0
    r.running()
    clock.t += 3
    r.begin(WorkerFailure("y", "master/0"), failed_step=None)
    assert r.backoff() == 4.0


def test_attempts_are_numbered_against_the_retries_they_draw_on():
    """What 'recovering (attempt N of 3)' says: N counts the stateful restarts, or that one
    stateless worker's restarts, never every recovery of the trial (no 'attempt 5 of 3')."""
    r = Recovery(RecoverConfig(retries=3), ("model", "master"), t0=0.0)
    a1 = r.begin(WorkerFailure("x", "master/0"), failed_step=1)
    g1 = r.begin(WorkerFailure("x", "rollout/0"), failed_step=2, restarted=["rollout/0"])
    g2 = r.begin(WorkerFailure("x", "rollout/1"), failed_step=2, restarted=["rollout/1"])
    g3 = r.begin(WorkerFailure("x", "rollout/0"), failed_step=3, restarted=["rollout/0"])
    a2 = r.begin(WorkerFailure("x", "model/1"), failed_step=4)
    assert [r.count(a) for a in (a1, g1, g2, g3, a2)] == [1, 1, 1, 2, 2]
    assert [a.attempt for a in (a1, g1, g2, g3, a2)] == [1, 2, 3, 4, 5]


def test_a_requeue_draws_on_no_retry_however_often_and_used_up_retries_are_named():
    from system.launcher.recovery import Requeued

    clock = Clock()
    r = Recovery(RecoverConfig(retries=1, backoff=3.0), ("model", "master"), t0=990.0,
                 clock=clock)
    for k in range(5):  # preempted again and again (a busy partition, time limits)
        requeued = Requeued("the job of master/0 was requeued (preempted or at its time "
                            "limit); log: x", "master/0")
        assert r.should_recover(requeued)
        a = r.begin(requeued, failed_step=10 * k)
        assert a.requeued and r.backoff() == 0.0
        clock.t += 1
        r.running()
    failure = WorkerFailure("worker model/0 exited", "model/0")
    assert r.should_recover(failure)  # the one retry is still there
    a = r.begin(failure, failed_step=50)
    assert r.count(a) == 1 and not a.requeued
    r.running()
    again = WorkerFailure("worker model/0 exited again", "model/0")
    assert not r.should_recover(again)
    named = r.unrecovered(again)
    assert str(named) == ("worker model/0 exited again\nnot recovered: recover.retries=1 "
                          "restarts of model, master are used up")
    assert named.worker == "model/0"
    assert r.should_recover(Requeued("requeued", "model/0"))  # still: not a failure
    assert [a["requeued"] for a in r.summary()] == [True] * 5 + [False]
    paused = r.begin(Paused("the controller was stopped for 20s", "master/0"), failed_step=51)
    assert (paused.paused, paused.requeued, paused.free) == (True, False, True)
    assert r.should_recover(Paused("stopped again", "master/0"))  # not a failure either
    assert [(a["requeued"], a["paused"]) for a in r.summary()][-2:] == [(False, False),
                                                                       (False, True)]
    config = WorkerFailure("bad prompt file", "master/0", config=True)
    assert r.unrecovered(config) is config  # never recovered: nothing to add
    gen = WorkerFailure("worker generation/0 died", "generation/0")
    r.begin(gen, failed_step=51, restarted=["generation/0"])
    assert str(r.unrecovered(gen)).endswith("recover.retries=1 restarts of generation/0 are "
                                            "used up")


def test_a_stateful_restart_lists_its_workers_and_leaves_the_stateless_retries_alone():
    r = Recovery(RecoverConfig(retries=1, backoff=0.0), ("model", "master"), t0=0.0,
                 clock=Clock())
    a = r.begin(Paused("the controller was stopped for 20s", "master/0"), failed_step=3)
    a.restarted = ["model/0", "master/0", "generation/0"]  # every kind restarted (a pause)
    gen = WorkerFailure("worker generation/0 died", "generation/0")
    assert r.should_recover(gen)  # its one retry: not used by the restart of every kind
    b = r.begin(gen, failed_step=4, restarted=["generation/0"])
    assert r.count(b) == 1
    r.running(["generation/0"])
    assert b.recovered_at_s is not None and a.recovered_at_s is None
    assert r.summary()[0]["restarted"] == ["model/0", "master/0", "generation/0"]


def test_respawned_workers_rejoining_at_one_poll_recover_each_their_own_attempt():
    clock = Clock()
    r = Recovery(RecoverConfig(retries=3, backoff=0.0), ("model", "master"), t0=990.0,
                 clock=clock)
    gen0 = r.begin(WorkerFailure("x", "generation/0"), failed_step=3, restarted=["generation/0"])
    clock.t += 1
    gen0_again = r.begin(WorkerFailure("y", "generation/0"), failed_step=3,
                         restarted=["generation/0"])  # it died again before rejoining
    gen1 = r.begin(WorkerFailure("x", "generation/1"), failed_step=3, restarted=["generation/1"])
    clock.t += 1
    roll = r.begin(WorkerFailure("x", "rollout/0"), failed_step=4, restarted=["rollout/0"])
    clock.t += 2
    r.running(["generation/1", "rollout/0", "generation/0"])
    assert gen0_again.recovered_at_s == gen1.recovered_at_s == roll.recovered_at_s == 14.0
    assert gen0.recovered_at_s is None  # superseded by its second respawn
    r.running(["generation/0"])  # a later report of the same worker changes nothing
    assert gen0.recovered_at_s is None and gen0_again.recovered_at_s == 14.0
    # a restart of every kind (a pause) after an unrecovered respawn: the worker's rejoin is
    # the later restart's, never the older respawn's
    gen2 = r.begin(WorkerFailure("z", "generation/2"), failed_step=5, restarted=["generation/2"])
    every = r.begin(Paused("the controller was stopped for 20s", "master/0"), failed_step=5)
    every.restarted = ["model/0", "master/0", "generation/2"]
    r.running(["generation/2"])
    assert gen2.recovered_at_s is None and every.recovered_at_s is None
