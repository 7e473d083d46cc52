"""RPC and streams over real sockets: timeouts, typed remote errors, bounded queues, drops."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from system.errors import RemoteError, RpcTimeout
from system.rpc import RpcClient, RpcServer, StreamPuller, StreamPusher
from system.wire import Codec, new_secret


@pytest.fixture
def codec():
    return Codec(new_secret(), max_message_bytes=1 << 20)


@pytest.fixture
def server(codec):
    def fail(msg: str):
        raise ValueError(msg)

    srv = RpcServer(codec, "127.0.0.1", {"add": lambda a, b: a + b, "fail": fail,
                                          "sleep": lambda s: time.sleep(s),
                                          "sum": lambda x: float(x.sum())})
    stop = threading.Event()
    t = threading.Thread(target=srv.serve_forever, args=(stop, 0.02), daemon=True)
    t.start()
    yield srv
    stop.set()
    t.join()
    srv.close()


def test_call_and_tensor_args(codec, server):
    c = RpcClient(codec, server.address, timeout=5)
    assert c.call("add", a=2, b=3) == 5
    assert c.call("sum", x=np.ones(1000)) == 1000.0
    c.close()


def test_remote_error_is_typed(codec, server):
    c = RpcClient(codec, server.address, timeout=5)
    with pytest.raises(RemoteError) as e:
        c.call("fail", msg="boom")
    assert e.value.type_name == "ValueError" and "boom" in e.value.remote_message
    assert "Traceback" in e.value.traceback_text
    with pytest.raises(RemoteError) as e:
        c.call("nope")
    assert e.value.type_name == "NoSuchMethod" and "add" in e.value.remote_message
    c.close()


def test_timeout_then_late_reply_discarded(codec, server):
    c = RpcClient(codec, server.address, timeout=5)
    with pytest.raises(RpcTimeout):
        c.call("sleep", timeout=0.1, s=0.4)
    assert c.call("add", a=1, b=1) == 2  # the late reply to the first call is not mistaken
    c.close()


def test_timeout_when_nobody_listens(codec):
    c = RpcClient(codec, "tcp://127.0.0.1:9", timeout=0.2)
    with pytest.raises(RpcTimeout):
        c.call("add", a=1, b=2)
    c.close()


def test_many_in_flight(codec, server):
    c = RpcClient(codec, server.address, timeout=5)
    ids = [c.submit("add", a=i, b=i) for i in range(50)]
    assert [c.result(r) for r in reversed(ids)] == [2 * i for i in reversed(range(50))]
    c.close()


def test_raw_garbage_is_dropped_and_counted(codec, server):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(server.address)
    raw.send_multipart([b"garbage"])                               # truncated
    raw.send_multipart([b"x" * 32, b"not msgpack", b"frame"])      # unauthenticated
    raw.send_multipart(Codec(new_secret()).encode({"id": 1, "m": "add", "a": {}}))  # wrong key
    raw.send_multipart(codec.encode({"id": 1, "m": "add", "a": {"x": np.zeros(200_000)}}))
    raw.send_multipart([bytes(f) for f in codec.encode({"no": "method"})])  # authentic nonsense
    c = RpcClient(codec, server.address, timeout=5)
    deadline = time.time() + 5
    while server.drops.total < 5 and time.time() < deadline:
        time.sleep(0.02)
    assert c.call("add", a=1, b=2) == 3   # still serving
    assert server.drops.as_dict() == {"malformed": 2, "unauthenticated": 2, "oversized": 1}
    raw.close(0)
    c.close()


def test_stream_roundtrip_and_bounded_queue(codec):
    puller = StreamPuller(codec, "127.0.0.1", hwm=2)
    pusher = StreamPusher(codec, puller.address, hwm=2)
    pusher.send({"i": 0, "t": np.arange(10)})
    msg = puller.recv(5)
    assert msg["i"] == 0 and np.array_equal(msg["t"], np.arange(10))
    big = np.zeros(200_000, np.uint8)  # fills socket buffers too, so the bound is reached
    with pytest.raises(RpcTimeout):
        for i in range(10_000):
            pusher.send({"i": i, "t": big}, timeout=0.2)
    assert i < 10_000
    got = 0
    while puller.recv(0.5) is not None:
        got += 1
    assert got == i  # nothing lost: every accepted message arrives
    pusher.close()
    puller.close()


def test_stream_drops_bad_messages(codec):
    puller = StreamPuller(codec, "127.0.0.1")
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(puller.address)
    raw.send_multipart([b"j" * 40, b"junk"])
    good = StreamPusher(codec, puller.address)
    good.send({"ok": 1})
    assert puller.recv(5) == {"ok": 1}
    deadline = time.time() + 5  # the two connections' messages may arrive in either order
    while puller.drops.unauthenticated < 1 and time.time() < deadline:
        puller.recv(0.05)
    assert puller.drops.as_dict() == {"malformed": 0, "unauthenticated": 1, "oversized": 0}
    raw.close(0)
    good.close()
    puller.close()


def test_deferred_replies_do_not_block_other_calls(codec):
    """A handler returning a Future is answered when it completes; meanwhile other requests are
    served (generation calls must not hold up each other or control calls)."""
    from concurrent.futures import Future

    pending: list[Future] = []

    def slow() -> Future:
        f: Future = Future()
        pending.append(f)
        return f

    def failing() -> Future:
        f: Future = Future()
        f.set_exception(ValueError("bad input"))
        return f

    srv = RpcServer(codec, "127.0.0.1", {"slow": slow, "fast": lambda: "fast",
                                         "failing": failing})
    stop = threading.Event()
    t = threading.Thread(target=srv.serve_forever, args=(stop,), daemon=True)
    t.start()
    c = RpcClient(codec, srv.address, 5.0)
    try:
        ids = [c.submit("slow") for _ in range(3)]
        assert c.call("fast") == "fast"           # served while three slow calls wait
        assert srv.pending == 3
        for i, f in enumerate(pending):
            f.set_result({"n": i, "t": np.arange(3)})
        got = [c.result(i) for i in ids]
        assert [g["n"] for g in got] == [0, 1, 2] and got[0]["t"].tolist() == [0, 1, 2]
        with pytest.raises(RemoteError, match="bad input"):
            c.call("failing")
        assert srv.pending == 0
    finally:
        c.close()
        stop.set()
        t.join()
        srv.close()
