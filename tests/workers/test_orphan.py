"""A worker stops by itself once its controller's liveness key has expired: real worker
processes, a real file name resolution; the test plays the controller (it writes the key with a
TTL and stops refreshing it, as a controller killed with -9 would)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from system import names
from system.bootstrap import Bootstrap
from system.name_resolve import FileNameResolve
from system.rpc import RpcClient
from system.wire import Codec
from tests.helpers import REPO, write_secret_file
from workers.client import WorkerClient

# a worker whose role runs until stopped; with "stuck", a role that never looks at `stopping`;
# with "slow", one that takes a second to unwind once stopped; with "exit", one that calls
# sys.exit(0) (as a user's code might)
PROBE = """
import logging, sys, threading, time
from system.bootstrap import Bootstrap
from workers.base import Worker

class Probe(Worker):
    kind = "probe"

def role(worker):
    if sys.argv[2] == "stuck":
        threading.Event().wait()
    if sys.argv[2] == "exit":
        sys.exit(0)
    while not worker.wait_stop(0.1):
        pass
    if sys.argv[2] == "slow":
        time.sleep(1.0)
    return {"orphaned": worker.orphaned}

logging.basicConfig(level=logging.INFO, stream=sys.stdout)
sys.exit(Probe(Bootstrap.read(sys.argv[1]), 0).run(role))
"""
ORPHAN_TIMEOUT = 1.5


@pytest.fixture
def trial(tmp_path):
    """A trial directory with its secret and bootstrap file, and its name resolution."""
    root = str(tmp_path / "nr")
    secret = write_secret_file(str(tmp_path))
    Bootstrap(exp="orph", trial="t", experiment="smoke", trial_dir=str(tmp_path),
              interface="127.0.0.1", scheduler="local", name_resolve={"type": "file"},
              name_resolve_root=root, rpc={}, heartbeat_ttl=2.0,
              orphan_timeout=ORPHAN_TIMEOUT).write(str(tmp_path / "bootstrap.json"))
    nr = FileNameResolve(root, secret=secret)
    yield tmp_path, nr, Codec(secret)
    nr.close()


def _start(tmp_path, nr: FileNameResolve, codec: Codec, mode: str = "serve"
           ) -> tuple[subprocess.Popen, WorkerClient]:
    """Start the probe worker, configure and start it as the controller would."""
    log = open(tmp_path / f"probe-{mode}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", PROBE, str(tmp_path / "bootstrap.json"), mode],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    address = nr.wait(names.worker_address("orph", "t", "probe", 0), 30)
    client = WorkerClient(RpcClient(codec, address, 10), "probe/0")
    client.configure({"worker": {}, "experiment": {}, "counts": {}, "recover": "off"}).result()
    client.start().result()
    return proc, client


def _log(tmp_path, mode: str = "serve") -> str:
    with open(tmp_path / f"probe-{mode}.log") as f:
        return f.read()


def test_worker_stops_when_the_controller_key_expires(trial):
    tmp_path, nr, codec = trial
    key = names.controller("orph", "t")
    nr.add(key, "controller", keepalive_ttl=0.6)
    proc, client = _start(tmp_path, nr, codec)
    try:
        time.sleep(1.0)
        assert client.ping().result()["state"] == "running"  # alive while the key is
        nr.close()  # the controller dies: nobody refreshes the key, it expires on its own
        gone = time.monotonic()
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - gone >= ORPHAN_TIMEOUT
        log = _log(tmp_path)
        assert "liveness key has been gone" in log and "stopping" in log
        assert "'orphaned': True" in log
        # stopped cleanly: it removed its own keys
        assert nr.find_subtree(names.worker_addresses("orph", "t")) == []
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_a_worker_that_never_sees_the_key_stops_after_the_orphan_timeout(trial):
    """The controller writes its key before it submits a job: a worker that does not see it
    within orphan_timeout of its start lost its controller while its job was queued (the
    launcher killed meanwhile) and stops too, instead of holding its node for good."""
    tmp_path, nr, codec = trial
    t0 = time.monotonic()
    proc, client = _start(tmp_path, nr, codec)
    try:
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 >= ORPHAN_TIMEOUT
        log = _log(tmp_path)
        assert "liveness key has not appeared since this worker started" in log, log
        assert "'orphaned': True" in log
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_a_worker_whose_controller_key_lives_keeps_running(trial):
    tmp_path, nr, codec = trial
    nr.add(names.controller("orph", "t"), "controller", keepalive_ttl=0.6)
    proc, client = _start(tmp_path, nr, codec)
    try:
        time.sleep(ORPHAN_TIMEOUT * 3)
        assert proc.poll() is None and client.ping().result()["state"] == "running"
        client.stop().result()
        assert proc.wait(timeout=20) == 0
        assert "liveness key" not in _log(tmp_path)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_a_worker_stopped_by_sigterm_reads_as_stopped_by_it_not_completed(trial):
    """An operator's ``kill`` (SIGTERM) stops the worker gracefully, but its exit says so:
    128 + 15, which the local scheduler reads as CANCELLED, "stopped by SIGTERM" (a worker
    the controller stopped exits 0: see the test above)."""
    from scheduler.local import exit_code_state, exit_detail
    from scheduler.base import JobState

    tmp_path, nr, codec = trial
    proc, client = _start(tmp_path, nr, codec)
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        assert code == 128 + signal.SIGTERM, _log(tmp_path)
        assert exit_code_state(code) == JobState.CANCELLED
        assert exit_detail(code) == "stopped by SIGTERM (exit code 143)"
        assert "got SIGTERM: stopping" in _log(tmp_path)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_a_role_that_calls_sys_exit_fails_and_says_so(trial):
    """``sys.exit(0)`` in a role's code (a user's function) ended the worker as if its role
    had finished: exit 0, its keys removed, no error reported (the controller read a master
    as completed and restarted it until its retries ran out, the cause named nowhere). It
    fails the worker now: exit 1, the ``SystemExit`` under its error key."""
    import json

    tmp_path, nr, codec = trial
    nr.add(names.controller("orph", "t"), "controller", keepalive_ttl=0.6)
    proc, client = _start(tmp_path, nr, codec, "exit")
    try:
        assert proc.wait(timeout=20) == 1, _log(tmp_path, "exit")
        error = json.loads(nr.get(names.worker_error("orph", "t", "probe", 0)))
        assert error["type"] == "SystemExit" and ", in role\n" in error["traceback"]
        assert error["traceback"].rstrip().endswith("SystemExit: 0")
        assert "probe/0 failed:" in _log(tmp_path, "exit")
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_stuck_orphan_exits_after_a_grace(trial):
    """A role that never looks at `stopping` (a collective whose peers are gone): the worker
    exits by itself anyway, with code 3, after a grace of max(orphan_timeout, 10 s), and logs
    every thread's stack first."""
    tmp_path, nr, codec = trial
    nr.add(names.controller("orph", "t"), "controller", keepalive_ttl=0.6)
    proc, client = _start(tmp_path, nr, codec, "stuck")
    try:
        time.sleep(0.5)
        nr.delete(names.controller("orph", "t"))  # the controller's key is gone
        assert proc.wait(timeout=30) == 3
        log = _log(tmp_path, "stuck")
        assert "did not stop within" in log
        # where it hung, for whoever reads the log: the role's own frame among the threads'
        # (the probe runs from a string: no source line is shown)
        assert 'File "<string>", line ' in log and ', in role\n' in log, log[-3000:]
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_alive_lists_the_workers_of_a_kind_whose_heartbeat_lives(trial):
    """``Worker.alive(kind)``: what the master (leases) and rollout workers (calls to a dead
    server) ask; keys of other kinds, and expired keys, do not count."""
    from workers.base import Worker

    tmp_path, nr, _ = trial
    w = Worker(Bootstrap.read(str(tmp_path / "bootstrap.json")), 0)
    nr.add(names.heartbeat("orph", "t", "rollout", 0), "1", keepalive_ttl=60)
    nr.add(names.heartbeat("orph", "t", "rollout", 12), "1", keepalive_ttl=60)
    nr.add(names.heartbeat("orph", "t", "generation", 3), "1", keepalive_ttl=60)
    nr.add(names.heartbeat("orph", "t", "rollout", 5), "1", keepalive_ttl=0.3)
    nr.close()  # stops refreshing: rollout/5's key expires
    time.sleep(0.6)
    assert w.alive("rollout") == {0, 12}
    assert w.alive("generation") == {3}
    assert w.alive("model") == set()
    w.name_resolve.close()
    w.server.close()


def test_heartbeats_missed_during_a_name_service_outage_are_no_news(trial):
    """Just after name resolution was seen down (a restarted Redis lost every key; each owner
    adds its own back within a heartbeat), ``alive`` and ``serving_at`` answer what they last
    read; once a heartbeat TTL (2 s here) has passed, only what is there counts."""
    from workers.base import Worker

    tmp_path, nr, _ = trial
    w = Worker(Bootstrap.read(str(tmp_path / "bootstrap.json")), 0)
    try:
        nr.add(names.heartbeat("orph", "t", "generation", 0), "1", keepalive_ttl=60)
        nr.add(names.worker_address("orph", "t", "generation", 0), "tcp://h:1")
        assert w.alive("generation") == {0}
        assert w.serving_at("generation", 0) == "tcp://h:1"
        nr.delete(names.heartbeat("orph", "t", "generation", 0))  # lost with the server
        nr.delete(names.worker_address("orph", "t", "generation", 0))
        w.name_resolve.outage_seen = time.monotonic()  # as the backend records it
        assert w.alive("generation") == {0}
        assert w.serving_at("generation", 0) == "tcp://h:1"
        w.name_resolve.outage_seen = time.monotonic() - 2.5  # a TTL later: the loss is news
        assert w.alive("generation") == set()
        assert w.serving_at("generation", 0) is None
    finally:
        w.name_resolve.close()
        w.server.close()


def test_a_signal_during_the_controller_s_stop_leaves_it_the_controller_s(trial):
    """The scheduler's SIGTERM to a worker slower than the grace (or a time limit's SIGUSR2 as
    the trial ends) came while the worker already stopped as the controller asked: it read as
    stopped by that signal (exit 143, its keys left to expire; SIGUSR2 also marked its job
    for a requeue after the trial). It is now a stop like any other: exit 0, keys removed."""
    tmp_path, nr, codec = trial
    nr.add(names.controller("orph", "t"), "controller", keepalive_ttl=0.6)
    proc, client = _start(tmp_path, nr, codec, mode="slow")
    try:
        client.stop().result()
        proc.send_signal(signal.SIGUSR2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, _log(tmp_path, "slow")
        log = _log(tmp_path, "slow")
        assert "got SIGTERM while stopping as the controller asked" in log, log
        assert "got SIGUSR2 while stopping as the controller asked" in log, log
        assert nr.find_subtree("orph/t/heartbeat") == [] and nr.find_subtree("orph/t/preempt") == []
        assert nr.find_subtree(names.worker_addresses("orph", "t")) == []
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_a_worker_leaves_keys_a_replacement_registered(trial):
    """A stopped worker removed its keys without looking whose they were: a replacement that
    had registered meanwhile (a respawn in a shared Slurm job) lost its own."""
    tmp_path, nr, codec = trial
    nr.add(names.controller("orph", "t"), "controller", keepalive_ttl=0.6)
    proc, client = _start(tmp_path, nr, codec, mode="slow")
    address = names.worker_address("orph", "t", "probe", 0)
    try:
        client.stop().result()
        nr.add(address, "tcp://127.0.0.1:1#replacement", replace=True)
        assert proc.wait(timeout=20) == 0, _log(tmp_path, "slow")
        assert nr.get(address) == "tcp://127.0.0.1:1#replacement"
        assert nr.find_subtree("orph/t/heartbeat") == []  # (its own: removed)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.redis
def test_a_worker_whose_name_service_and_controller_are_gone_stops(tmp_path):
    """The login node that ran the launcher and the Redis server went down: every read of the
    controller's key failed, and each failure restarted the orphan clock, so the workers ran
    on for good. Now a worker stops once the key has not been seen for ``orphan_timeout``
    plus the name service's outage budget (a live controller fails the trial by then)."""
    from system.name_resolve import RedisNameResolve
    from tests.helpers import free_port, start_redis

    port = free_port()
    redis = start_redis(port)
    secret = write_secret_file(str(tmp_path))
    nr_cfg = {"type": "redis", "redis_port": port, "redis_outage_timeout": 2.0}
    Bootstrap(exp="orph", trial="t", experiment="smoke", trial_dir=str(tmp_path),
              interface="127.0.0.1", scheduler="local", name_resolve=nr_cfg,
              name_resolve_root="", rpc={}, heartbeat_ttl=2.0,
              orphan_timeout=ORPHAN_TIMEOUT).write(str(tmp_path / "bootstrap.json"))
    nr = RedisNameResolve("127.0.0.1", port, secret=secret, outage_timeout=2.0)
    nr.add(names.controller("orph", "t"), "controller", keepalive_ttl=0.6)
    proc = client = None
    try:
        proc, client = _start(tmp_path, nr, Codec(secret))
        time.sleep(1.0)
        assert client.ping().result()["state"] == "running"
        redis.kill()  # the name service, and the controller with it
        redis.wait(10)
        gone = time.monotonic()
        assert proc.wait(timeout=30) == 0, _log(tmp_path)
        assert time.monotonic() - gone >= ORPHAN_TIMEOUT
        log = _log(tmp_path)
        assert "the name service has not answered for" in log, log[-3000:]
        assert "the controller is dead, stopping" in log and "'orphaned': True" in log
    finally:
        if client is not None:
            client.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
        nr.close()
        if redis.poll() is None:
            redis.kill()
            redis.wait(10)
