"""Typed client calls: fan-out, and waits that notice a dead server."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from system.errors import CallAbandoned, PeerDied, RpcTimeout
from system.rpc import RpcClient, RpcServer
from system.wire import Codec, new_secret
from workers.client import Pending, collect, collect_settled


@pytest.fixture
def served():
    """A real server whose ``slow`` handler answers after ``delay`` seconds (0: never)."""
    codec = Codec(new_secret())

    def slow(delay: float) -> Future:
        fut: Future = Future()
        if delay:
            threading.Timer(delay, fut.set_result, args=(f"after {delay}",)).start()
        return fut

    server = RpcServer(codec, "127.0.0.1", {"slow": slow, "echo": lambda x: x})
    stop = threading.Event()
    thread = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
    thread.start()
    client = RpcClient(codec, server.address, timeout=10)
    yield client
    client.close()
    stop.set()
    thread.join(5)
    server.close()


def test_collect_in_order_and_settled(served):
    assert collect([Pending(served, "echo", {"x": i}) for i in range(5)], 5) == list(range(5))
    out = collect_settled([Pending(served, "echo", {"x": 1}),
                           Pending(served, "slow", {"delay": 0})], 3)
    assert out[0] == 1 and isinstance(out[1], RpcTimeout)


def test_a_dead_server_fails_the_wait_at_once(served):
    checks = []

    def alive() -> bool:
        checks.append(time.monotonic())
        return len(checks) < 2  # the server "dies" at the second look

    t0 = time.monotonic()
    with pytest.raises(PeerDied, match="slow"):
        Pending(served, "slow", {"delay": 0}).result_while(alive, timeout=60, check_every=0.2)
    assert time.monotonic() - t0 < 5 and len(checks) == 2


def test_a_live_server_answers_across_checks(served):
    # the reply comes after several checks: waiting in slices must not drop it
    got = Pending(served, "slow", {"delay": 1.0}).result_while(lambda: True, timeout=10,
                                                                check_every=0.2)
    assert got == "after 1.0"


def test_the_whole_timeout_still_holds(served):
    t0 = time.monotonic()
    with pytest.raises(RpcTimeout):
        Pending(served, "slow", {"delay": 0}).result_while(lambda: True, timeout=1.0,
                                                            check_every=0.3)
    assert time.monotonic() - t0 < 3


def test_a_caller_asked_to_stop_abandons_its_waits(served):
    """A master stopped by the controller mid-step waits no longer on a model worker's reply
    (one stopped at the same time may never read the request): within ``check_every`` of the
    stop, the call is abandoned; replies that come before the stop are still returned."""
    stopped = threading.Event()
    assert collect([Pending(served, "slow", {"delay": 0.5})], 10, stopped.is_set) \
        == ["after 0.5"]
    threading.Timer(0.5, stopped.set).start()
    t0 = time.monotonic()
    with pytest.raises(CallAbandoned, match="slow .*the caller is stopping"):
        collect([Pending(served, "slow", {"delay": 0})], 60, stopped.is_set)
    assert time.monotonic() - t0 < 3
    out = collect_settled([Pending(served, "echo", {"x": 1}),
                           Pending(served, "slow", {"delay": 0})], 60, stopped.is_set)
    assert out[0] == 1 and isinstance(out[1], CallAbandoned)


def test_a_fan_out_s_timeout_is_the_whole_fan_out_s(served):
    """Requests that went out together share the timeout: peers that never answer (a stop sent
    to workers that already ended) cost it once, not once each (the controller's stop of 8
    gone workers took 16 s at 2 s each)."""
    calls = [Pending(served, "slow", {"delay": 0}) for _ in range(4)] + \
        [Pending(served, "echo", {"x": 7})]
    t0 = time.monotonic()
    out = collect_settled(calls, 0.5)
    assert time.monotonic() - t0 < 1.5
    assert all(isinstance(e, RpcTimeout) and "within 0.5s" in str(e) for e in out[:4]), out
    assert out[4] == 7  # (answered meanwhile: read though the deadline has passed)
    t0 = time.monotonic()
    with pytest.raises(RpcTimeout, match="within 0.3s"):
        collect([Pending(served, "slow", {"delay": 0}) for _ in range(4)], 0.3)
    assert time.monotonic() - t0 < 1.0
