"""NameWatch: what the controller reads while it watches, over real backends and real
keep-alive threads."""
from __future__ import annotations

import json
import time

import pytest

from system import names
from system.errors import ConfigError
from system.launcher.watch import NameWatch
from system.name_resolve import FileNameResolve, NameResolve, RedisNameResolve
from system.wire import new_secret

SECRET = new_secret()
TTL = 0.6


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request, tmp_path):
    """A factory of clients of one backend: the controller's and each worker's."""
    made: list[NameResolve] = []
    ns = f"w{time.time_ns()}"

    def make() -> NameResolve:
        if request.param == "file":
            nr: NameResolve = FileNameResolve(str(tmp_path / "nr"), secret=SECRET)
        else:
            host, port = request.getfixturevalue("redis_server")
            nr = RedisNameResolve(host, port, namespace=ns, secret=SECRET)
        made.append(nr)
        return nr

    yield make
    for nr in made:
        nr.close()


def _register(nr: NameResolve, i: int) -> None:
    nr.add(names.heartbeat("e", "t", "rollout", i), "pid", replace=True, keepalive_ttl=TTL)
    nr.add(names.worker_address("e", "t", "rollout", i), f"tcp://h:{i}", replace=True)


def _until(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_silent_and_deleted_workers_stop_beating_within_the_ttl(backend):
    workers = [f"rollout/{i}" for i in range(3)]
    clients = [backend() for _ in workers]
    for i, nr in enumerate(clients):
        _register(nr, i)
    watch = NameWatch(backend(), "e", "t", recheck=TTL)
    assert watch.registered() == {w: f"tcp://h:{i}" for i, w in enumerate(workers)}
    assert watch.poll(workers).beating == set(workers)
    reads = watch.nr.ops["read"]
    for _ in range(5):  # live heartbeats are not read again before they could have expired
        assert watch.beating(workers) == set(workers)
    assert watch.nr.ops["read"] == reads
    time.sleep(TTL * 2)  # they are refreshed meanwhile: still beating
    # (a keep-alive thread starved for a TTL on a loaded machine is seen to stop beating until
    # its next refresh: CI saw it once; wait that out, within a few TTLs)
    _until(lambda: watch.beating(workers) == set(workers), 5 * TTL)
    # the watch never takes a silent or deleted heartbeat for alive past one TTL from then
    # (what it holds is checked, not the wall time its polls took: a loaded machine stalls them)
    for worker, silence in (("rollout/1", clients[1].close),  # it stops refreshing
                            ("rollout/2", lambda: clients[2].delete(
                                names.heartbeat("e", "t", "rollout", 2)))):
        held: list[float] = []
        silence()  # (a close joins the refresher: no refresh comes after it)
        t0 = time.time()
        _until(lambda: held.append(watch._live_until.get(worker, 0.0)) or
               worker not in watch.beating(workers), 10 * TTL)
        assert max(held) <= t0 + TTL + 0.2, (max(held) - t0, worker)
    _until(lambda: watch.beating(workers) == {"rollout/0"}, 5 * TTL)


def test_addresses_of_rejoining_workers_at_every_poll_of_all_now_and_then(backend):
    nr = backend()
    for i in range(3):
        _register(nr, i)
    workers = ["rollout/0", "rollout/1", "rollout/2"]
    now = [time.time()]  # (its own clock: a stall between two calls must not count)
    watch = NameWatch(backend(), "e", "t", recheck=TTL, clock=lambda: now[0])
    assert watch.addresses(workers) == {w: f"tcp://h:{i}" for i, w in enumerate(workers)}
    nr.add(names.worker_address("e", "t", "rollout", 1), "tcp://new:1", replace=True)
    nr.add(names.worker_address("e", "t", "rollout", 2), "tcp://new:2", replace=True)
    now[0] += TTL / 2 - 0.01
    assert watch.addresses(workers, rejoining=["rollout/1"]) == {"rollout/1": "tcp://new:1"}
    now[0] += 0.02
    assert watch.addresses(workers)["rollout/2"] == "tcp://new:2"  # a moved worker is seen


def test_errors_and_bad_recheck(backend):
    nr = backend()
    nr.add(names.worker_error("e", "t", "rollout", 4), json.dumps({"type": "E"}))
    watch = NameWatch(backend(), "e", "t", recheck=1.0)
    assert watch.poll([]).errors == {"e/t/error/rollout/4": '{"type": "E"}'}
    with pytest.raises(ConfigError, match="recheck"):
        NameWatch(nr, "e", "t", recheck=0)


def test_registration_listing_is_paced_by_its_own_cost(backend):
    nr = backend()
    for i in range(50):
        _register(nr, i)
    watch = NameWatch(backend(), "e", "t", recheck=1.0)
    assert watch.registration_interval(0.02) == 0.02  # nothing listed yet
    t0 = time.monotonic()
    assert len(watch.registered()) == 50
    took = time.monotonic() - t0
    assert watch.registration_interval(0.02) == pytest.approx(min(max(0.02, 9 * took), 1.0),
                                                              rel=0.1)
    assert watch.registration_interval(0.02, maximum=0.001) == 0.02


def _job(state: str, *workers: str):
    from scheduler.jobs import JobState, JobStatus
    return JobStatus("1", JobState(state), workers, tuple(f"{w}.log" for w in workers))


def test_only_a_running_job_of_one_worker_vouches_for_its_process():
    from system.launcher.watch import vouched
    assert vouched([_job("RUNNING", "model/0"), _job("RUNNING", "model/1", "model/2"),
                    _job("PENDING", "master/0"), _job("FAILED", "rollout/0"),
                    _job("UNKNOWN", "rollout/1")]) == {"model/0"}


def test_workers_sharing_a_running_job_are_asked_of_their_witnesses(backend):
    from system.launcher.watch import shared
    jobs = [_job("RUNNING", "model/0"), _job("RUNNING", "model/1", "model/2"),
            _job("PENDING", "rollout/0", "rollout/1")]
    assert shared(jobs) == {"model/1", "model/2"}
    nr = backend()
    nr.add(names.alive("e", "t", "model", 1), "n1:77", replace=True, keepalive_ttl=TTL)
    nr.add(names.alive("e", "t", "model", 2), "n1:78", replace=True, keepalive_ttl=TTL)
    nr.delete(names.alive("e", "t", "model", 2))  # its witness saw its process die
    watch = NameWatch(backend(), "e", "t", recheck=TTL)
    assert watch.alive(shared(jobs)) == {"model/1": "n1:77"} and watch.alive([]) == {}


def test_a_silent_worker_whose_process_runs_is_late_first_and_hung_after_the_grace():
    """The controller's judgement of expired heartbeats (what a starved heartbeat thread on a
    busy machine looks like, against a hang or a death)."""
    from system.launcher.watch import LateBeats
    now = [100.0]
    late = LateBeats(30.0, clock=lambda: now[0])
    # rollout/0's process ended (or no scheduler vouches for it): dead at once
    assert late.judge(["model/0", "rollout/0"], {"model/0"}) == (["rollout/0"], ["model/0"])
    now[0] += 20
    assert late.judge(["model/0"], {"model/0"}) == ([], [])  # still within the grace
    now[0] += 11
    assert late.judge(["model/0"], {"model/0"}) == (["model/0"], [])  # hung
    # it beat again meanwhile: forgotten, its next silence is late anew
    assert late.judge([], {"model/0"}) == ([], [])
    assert late.judge(["model/0"], {"model/0"}) == ([], ["model/0"])
    # its process ended while it was late: dead at once
    now[0] += 1
    assert late.judge(["model/0"], set()) == (["model/0"], [])
    assert "judged hung if still silent in 30s" in late.describe(5.0)
    # grace 0: the expiry is the judgement, as without a scheduler's word
    assert LateBeats(0.0).judge(["model/0"], {"model/0"}) == (["model/0"], [])
    with pytest.raises(ConfigError, match="grace must be >= 0"):
        LateBeats(-1.0)
