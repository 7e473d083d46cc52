"""An RPC send is under the call's timeout: where ZeroMQ would block it forever (the queue to a
gone peer full, or the only connection dropped after a failed handshake), the call fails with
NotSent after the client's timeout, and only that call."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from system.errors import ClientClosed, NotSent, RpcError, RpcTimeout
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
                t0 = time.monotonic()  # the next call does not wait the timeout again
                with pytest.raises(NotSent, match="not sent at once"):
                    c.call("add", a=1, b=2, timeout=10)
                found["next"] = time.monotonic() - t0
                return
            time.sleep(0.1)  # (queued: the handshake has not failed yet)

    t = threading.Thread(target=send_until_refused, daemon=True)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive(), "a send blocked past the client's timeout"
        assert 0.25 <= found["waited"] < 5 and found["next"] < 0.1, found
    finally:
        stop.set()
        c.close()
        listener.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_client_whose_peer_takes_requests_again_waits_as_before(codec):
    """After a send that found no peer, the next ones fail at once while the queue stays full
    (not the timeout each), and go through again as soon as a peer takes what was queued."""
    port = _free_port()
    c = RpcClient(codec, f"tcp://127.0.0.1:{port}", timeout=0.2)
    sent = 0
    while True:  # (no listener yet: the requests queue up to the high-water mark)
        req = c.submit("add", a=1, b=2)
        try:
            c.result(req, timeout=0)
        except NotSent:
            break
        except RpcTimeout:
            sent += 1
    t0 = time.monotonic()
    for _ in range(20):
        with pytest.raises(NotSent, match="not sent at once"):
            c.call("add", a=1, b=2)
    assert time.monotonic() - t0 < 0.1 and sent >= 100
    ctx = zmq.Context.instance()
    peer = ctx.socket(zmq.ROUTER)  # a peer that reads (and answers nothing)
    peer.bind(f"tcp://127.0.0.1:{port}")
    try:
        assert peer.poll(5000), "the queued requests never reached the peer"
        drained = 0
        while peer.poll(200):
            peer.recv_multipart()
            drained += 1
        assert drained >= sent
        with pytest.raises(RpcTimeout, match="no reply"):  # sent this time: no NotSent
            c.call("add", a=1, b=2, timeout=0.2)
        assert peer.poll(1000)
    finally:
        peer.close(linger=0)
        c.close()


def test_a_closed_client_says_so(codec):
    """A client replaced (and closed) while someone still held it: an RpcError saying so, not
    ZeroMQ's error on a closed socket."""
    c = RpcClient(codec, "tcp://127.0.0.1:9", timeout=0.2)
    req = c.submit("add", a=1, b=2)
    c.close()
    with pytest.raises(ClientClosed, match="this client was closed"):
        c.result(req)
    with pytest.raises(ClientClosed, match="add to tcp://127.0.0.1:9"):
        Pending(c, "add", {"a": 1, "b": 2})
    assert issubclass(ClientClosed, RpcError)
