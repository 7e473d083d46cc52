"""An RPC send is under the call's timeout: where ZeroMQ would block it forever (the queue to a
gone peer full, or the only connection dropped after a failed handshake), the call fails with
NotSent after the client's timeout, and only that call."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from system.errors import NotSent, RpcTimeout
from system.rpc import RpcClient
from system.wire import Codec, new_secret
from workers.client import Pending


@pytest.fixture
def codec():
    return Codec(new_secret(), max_message_bytes=1 << 20)


def test_a_send_nobody_takes_fails_the_call_after_its_timeout(codec):
    """Requests to a peer that is gone queue up to ZeroMQ's send high-water mark; the send after
    that blocked, without a timeout, forever (a master pinging a dead worker every round). It
    now waits the client's timeout, and then only that call fails, with RpcTimeout."""
    c = RpcClient(codec, "tcp://127.0.0.1:9", timeout=0.3)
    found: dict[str, float] = {}

    def fill() -> None:
        for i in range(5000):
            t0 = time.monotonic()
            req = c.submit("add", a=i, b=i)
            if time.monotonic() - t0 >= 0.25:
                found.update(req=req, queued=i)
                t0 = time.monotonic()
                with pytest.raises(NotSent, match="not sent within 0.3s"):
                    c.result(req, timeout=10)
                found["raised_in"] = time.monotonic() - t0
                return

    t = threading.Thread(target=fill, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "a send blocked past the client's timeout"
    assert found and found["queued"] >= 100, found  # (ZeroMQ's default: 1000)
    assert found["raised_in"] < 0.1  # it was never sent: no reply to wait for
    with pytest.raises(RpcTimeout, match="no reply"):  # one queued before: waited for as ever
        c.result(found["req"] - 1, timeout=0.05)
    # a wait in slices (Pending.result_unless, result_while) ends at once too, not at its end
    pending = Pending(c, "add", {"a": 1, "b": 2})
    t0 = time.monotonic()
    with pytest.raises(NotSent):
        pending.result_unless(lambda: False, timeout=10)
    assert time.monotonic() - t0 < 0.1
    c.close()


def test_a_send_to_a_port_now_held_by_another_service_fails_after_its_timeout():
    """A gone CURVE peer's port, taken by a service that speaks something else (here bytes as
    from gloo's TCP pairs): the handshake fails, ZeroMQ drops the client's only queue, and the
    next send blocked forever. It now fails that call with RpcTimeout after the timeout."""
    curve = Codec(new_secret(), max_message_bytes=1 << 20, curve=True)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def other_service() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(bytes(range(256)))
                stop.wait(0.5)

    threading.Thread(target=other_service, daemon=True).start()
    c = RpcClient(curve, f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout=0.3)
    found: dict[str, float] = {}

    def send_until_refused() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            req = c.submit("add", a=1, b=2)
            if time.monotonic() - t0 >= 0.25:
                with pytest.raises(RpcTimeout, match="not sent within"):
                    c.result(req)
                found["waited"] = time.monotonic() - t0
                return
            time.sleep(0.1)  # (queued: the handshake has not failed yet)

    t = threading.Thread(target=send_until_refused, daemon=True)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive(), "a send blocked past the client's timeout"
        assert 0.25 <= found["waited"] < 5, found
    finally:
        stop.set()
        c.close()
        listener.close()
