"""A Redis server that stops answering: operations wait for it (``outage_timeout``), a server
that came back without its data gets every live process's entries back, and one that stays
down fails an operation in one line. Each test runs a redis-server of its own, killed and
started again on the same port."""
from __future__ import annotations

import re
import threading
import time

import pytest

from system.errors import ConfigError, NameEntryNotFound, NameResolveError
from system.name_resolve import NameResolveConfig, RedisNameResolve
from system.wire import new_secret
from tests.helpers import free_port, start_redis

pytestmark = pytest.mark.redis
SECRET = new_secret()


@pytest.fixture
def server():
    """``[port, process]`` of a private redis-server (the test may replace the process)."""
    port = free_port()
    box = [port, start_redis(port)]
    yield box
    box[1].kill()
    box[1].wait(10)


def _kill(box) -> None:
    box[1].kill()
    box[1].wait(10)


def test_a_restarted_server_gets_back_the_entries_of_live_processes(server):
    port = server[0]
    owner = RedisNameResolve("127.0.0.1", port, namespace="o", secret=SECRET, outage_timeout=20)
    reader = RedisNameResolve("127.0.0.1", port, namespace="o", secret=SECRET, outage_timeout=20)
    try:
        owner.add("e/t/worker/model/0", "tcp://h:1")
        owner.add("e/t/heartbeat/model/0", "1", keepalive_ttl=1.5)
        owner.add("e/t/gone", "x")
        owner.delete("e/t/gone")  # deleted: not added back
        _kill(server)
        restart = threading.Timer(1.5, lambda: server.__setitem__(1, start_redis(port)))
        restart.start()
        t0 = time.monotonic()
        # the reader waits for the server (no error), which answers without any entry until
        # the owner's own calls (its keep-alive refresh, within ttl/3) meet the new server
        deadline = time.monotonic() + 10
        while True:
            try:
                assert reader.get("e/t/worker/model/0") == "tcp://h:1"
                break
            except NameEntryNotFound:
                assert time.monotonic() < deadline, "the owner's entry did not come back"
                time.sleep(0.1)
        restart.join()
        assert time.monotonic() - t0 >= 1.0  # it did wait out the outage
        deadline = time.monotonic() + 5  # the owner's thread counts once it has added them all
        while owner.restored != 1:
            assert time.monotonic() < deadline, owner.restored
            time.sleep(0.05)
        assert reader.get("e/t/heartbeat/model/0") == "1"  # the keep-alive refresh's
        with pytest.raises(NameEntryNotFound):
            reader.get("e/t/gone")
        # the outage is known to both processes, for the grace their heartbeats get
        assert owner.outage_seen is not None and reader.outage_seen is not None
    finally:
        owner.close()
        reader.close()


def test_a_restart_between_two_calls_is_seen_on_the_new_connection(server):
    """No call of the process fails (the client reconnects by itself): the new connection's
    server is asked who it is, and a new process gets the entries back; a new connection to
    the same server adds nothing."""
    port = server[0]
    owner = RedisNameResolve("127.0.0.1", port, namespace="b", secret=SECRET, outage_timeout=20)
    reader = RedisNameResolve("127.0.0.1", port, namespace="b", secret=SECRET, outage_timeout=20)
    try:
        owner.add("e/t/stream/trajectories", "tcp://h:9")
        owner._r.connection_pool.disconnect()  # a new connection, to the same server
        assert owner.get("e/t/stream/trajectories") == "tcp://h:9"
        assert owner.restored == 0 and owner.outage_seen is None
        _kill(server)
        server[1] = start_redis(port)  # a new server without the data
        with pytest.raises(NameEntryNotFound):
            reader.get("e/t/stream/trajectories")
        owner.find_subtree("e/t")  # any call: it reconnects, and sees the new server
        assert owner.restored == 1 and owner.outage_seen is not None
        assert reader.get("e/t/stream/trajectories") == "tcp://h:9"
    finally:
        owner.close()
        reader.close()


def test_a_server_that_stays_down_fails_an_operation_in_one_line(server):
    nr = RedisNameResolve("127.0.0.1", server[0], namespace="d", secret=SECRET,
                          outage_timeout=1.0)
    try:
        nr.add("e/t/a", "1")
        _kill(server)
        t0 = time.monotonic()
        with pytest.raises(NameResolveError) as e:
            nr.get("e/t/a")
        waited = time.monotonic() - t0
        assert 1.0 <= waited < 5.0
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"redis at 127.0.0.1:{server[0]} did not answer for 1s "
                              "(name_resolve.redis_outage_timeout): ")
        with pytest.raises(NameResolveError):  # every kind of call, a subtree listing too
            nr.find_subtree("e/t")
    finally:
        nr.close()


def test_a_stopping_process_waits_out_no_outage(server):
    """A stop during an outage waited for the whole outage timeout: the keep-alive thread held
    its lock through a refresh retried for 30 s, so removing the process's keys (delete,
    release, clear_subtree) waited behind it, and calls already retrying kept on."""
    nr = RedisNameResolve("127.0.0.1", server[0], namespace="s", secret=SECRET,
                          outage_timeout=20)
    try:
        nr.add("e/t/hb", "1", keepalive_ttl=1.5)  # refreshed every 0.5 s
        nr.add("e/t/addr", "tcp://x")
        _kill(server)
        time.sleep(1.0)  # the keep-alive thread meets the outage
        got: list[BaseException] = []

        def read() -> None:
            try:
                nr.get("e/t/addr")
            except BaseException as e:  # noqa: BLE001 - what the call raised is the result
                got.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)  # the read is retrying (for up to 20 s)
        t0 = time.monotonic()
        nr.stopping(1.0)
        reader.join(10)
        assert not reader.is_alive() and isinstance(got[0], NameResolveError)
        with pytest.raises(NameResolveError):
            nr.delete("e/t/hb")  # not behind a refresh that retries for 20 s
        assert time.monotonic() - t0 < 8.0  # (20 s before; 2 s here unloaded)
        assert nr.outage_timeout == 0.0  # one waited in vain: the others try once
    finally:
        nr.close()


def test_a_server_that_refuses_writes_or_the_client_fails_at_once_in_one_line(server):
    """A read-only replica (a failover, or the wrong host) and a password asked for now (a
    restart with ``requirepass``) answer: they are refusals, named at once, not an outage
    waited out for ``redis_outage_timeout`` and named "did not answer" (or, for a refused
    write, a raw ``ReadOnlyError`` traceback out of the launcher)."""
    import redis as redis_py

    from system.errors import ConfigError, NameServiceRefused

    port = server[0]
    nr = RedisNameResolve("127.0.0.1", port, namespace="r", secret=SECRET, outage_timeout=20)
    admin = redis_py.Redis(port=port)
    try:
        nr.add("e/t/a", "1")
        admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # (a primary that never answers)
        t0 = time.monotonic()
        with pytest.raises(NameServiceRefused) as e:
            nr.add("e/t/b", "2")
        assert time.monotonic() - t0 < 2.0 and isinstance(e.value, ConfigError)
        assert str(e.value) == (f"redis at 127.0.0.1:{port} refused an operation: You can't "
                                "write against a read only replica.")
        assert nr.get("e/t/a") == "1"  # reads are served
        admin.execute_command("REPLICAOF", "NO", "ONE")
        admin.config_set("requirepass", "pw")
        admin.client_kill_filter(_type="normal", skipme=True)  # the client must log in again
        t0 = time.monotonic()
        with pytest.raises(NameServiceRefused, match=rf"^redis at 127.0.0.1:{port} refused this "
                                                     r"client's password, or asks for one now "
                                                     r"\(name_resolve.redis_password_file"):
            nr.get("e/t/a")
        assert time.monotonic() - t0 < 2.0
    finally:
        nr.close()
        admin.close()


def test_a_frozen_server_holds_a_stopping_process_no_longer_than_its_budget(server):
    """A server that takes connections but never answers (stopped, a black-holed network):
    each try waited 10 s for its answer, and the first failure was tried again at once, so a
    stopping process (3 s budget) took 30 s for one call (a trial's stop took 52 s, and
    ``ctl cancel`` ended with the launcher SIGKILLed). Now a try waits 3 s and counts."""
    import signal

    nr = RedisNameResolve("127.0.0.1", server[0], namespace="f", secret=SECRET,
                          outage_timeout=20)
    try:
        nr.add("e/t/a", "1")
        server[1].send_signal(signal.SIGSTOP)
        nr.stopping(3.0)
        t0 = time.monotonic()
        with pytest.raises(NameResolveError) as e:
            nr.get("e/t/a")
        took = time.monotonic() - t0
        assert took < 8.0, took
        assert re.search(rf"redis at 127.0.0.1:{server[0]} did not answer for [3-7]s",
                         str(e.value)), str(e.value)
    finally:
        server[1].send_signal(signal.SIGCONT)
        nr.close()


def test_the_outage_timeout_is_validated():
    assert NameResolveConfig(redis_outage_timeout=0).redis_outage_timeout == 0
    with pytest.raises(ConfigError, match="redis_outage_timeout=-1"):
        NameResolveConfig(redis_outage_timeout=-1)
