"""RPC and streams over real sockets: timeouts, typed remote errors, bounded queues, drops."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from system.errors import RemoteError, RpcTimeout, WireError
from system.replay import Receiver, Sender
from system.rpc import RpcClient, RpcServer
from system.streams import StreamPuller, StreamPusher
from system.sockets import bind, endpoint, make_socket
from system.wire import Channel, Codec, new_secret, recipient_id


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


def _raw(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint(address))
    return sock


def _request(codec: Codec, address: str, method: str, **args) -> list:
    """The frames of a request to ``address``, as a client sends them (and a sniffer sees)."""
    return [bytes(f) for f in Sender(codec, Channel.REQUEST).seal(
        {"m": method, "a": args}, recipient_id(address)).frames]


def _wait_drops(server, n: int) -> None:
    deadline = time.time() + 5
    while server.drops.total < n and time.time() < deadline:
        time.sleep(0.02)


def test_raw_garbage_is_dropped_and_counted(codec, server):
    raw = _raw(zmq.DEALER, server.address)
    big = Codec(codec._secret, 1 << 30)
    raw.send_multipart([b"garbage"])                               # truncated
    raw.send_multipart([b"x" * 80, b"not msgpack", b"frame"])      # unauthenticated
    raw.send_multipart(_request(Codec(new_secret()), server.address, "add"))  # wrong key
    raw.send_multipart(_request(big, server.address, "add",  # 2 x 0.6 MB: each frame fits
                                x=np.zeros(75_000), y=np.zeros(75_000)))
    raw.send_multipart([bytes(f) for f in Sender(codec, Channel.REQUEST).seal(
        {"no": "method"}, recipient_id(server.address)).frames])  # authentic nonsense
    c = RpcClient(codec, server.address, timeout=5)
    _wait_drops(server, 5)
    assert c.call("add", a=1, b=2) == 3   # still serving
    assert server.drops.as_dict() == {"malformed": 2, "unauthenticated": 2, "oversized": 1,
                                      "replayed": 0, "misdirected": 0}
    raw.close(0)
    c.close()


@pytest.mark.parametrize("args", [np.arange(3), np.zeros(1), 0, "", [], None, "missing"])
def test_authentic_requests_whose_args_are_no_map_are_dropped(codec, server, args):
    """Found by tests/fuzzing: ``a`` was read as ``payload.get("a") or {}``, so an array of
    several elements raised out of the serving loop (the worker stopped answering), and 0, "",
    [], None, a falsy array or no ``a`` at all called the method with no arguments."""
    payload = {"m": "add"} if isinstance(args, str) and args == "missing" else {"m": "add",
                                                                              "a": args}
    raw = _raw(zmq.DEALER, server.address)
    raw.send_multipart([bytes(f) for f in Sender(codec, Channel.REQUEST).seal(
        payload, recipient_id(server.address)).frames])
    _wait_drops(server, 1)
    assert server.drops.malformed == 1 and not raw.poll(100)  # counted, and no reply
    c = RpcClient(codec, server.address, timeout=5)
    assert c.call("add", a=1, b=2) == 3  # still serving
    raw.close(0)
    c.close()


def test_replayed_request_is_dropped_by_the_same_and_any_other_server(codec):
    """A captured request, sent again to its server or to another one, has no effect."""
    bumps = {"a": 0, "b": 0}
    servers = {k: RpcServer(codec, "127.0.0.1", {"bump": lambda k=k: bumps.update({k: bumps[k] + 1})
                                                  or bumps[k]}) for k in bumps}
    stop = threading.Event()
    threads = [threading.Thread(target=s.serve_forever, args=(stop, 0.02), daemon=True)
               for s in servers.values()]
    for t in threads:
        t.start()
    captured = _request(codec, servers["a"].address, "bump")
    raw_a, raw_b = _raw(zmq.DEALER, servers["a"].address), _raw(zmq.DEALER, servers["b"].address)
    try:
        raw_a.send_multipart(captured)
        assert raw_a.poll(5000) and bumps["a"] == 1          # the original is served
        raw_a.recv_multipart()
        raw_a.send_multipart(captured)                       # replayed to its server
        raw_b.send_multipart(captured)                       # and to another worker
        _wait_drops(servers["a"], 1)
        _wait_drops(servers["b"], 1)
        assert not raw_a.poll(300) and not raw_b.poll(10)    # no reply, no effect
        assert bumps == {"a": 1, "b": 0}
        assert servers["a"].drops.replayed == 1 and servers["a"].drops.total == 1
        assert servers["b"].drops.misdirected == 1 and servers["b"].drops.total == 1
        c = RpcClient(codec, servers["a"].address, timeout=5)
        assert c.call("bump") == 2                           # the next real call: +1
        c.close()
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in servers.values():
            s.close()
        raw_a.close(0)
        raw_b.close(0)


def test_replayed_reply_is_dropped(codec):
    """A reply is accepted once, by the client and for the request it answers."""
    sock = make_socket(codec, zmq.ROUTER)  # a server the test drives by hand
    address = bind(sock, "127.0.0.1")
    requests, replies = Receiver(codec, Channel.REQUEST, address), Sender(codec, Channel.REPLY)
    c = RpcClient(codec, address, timeout=5)

    def serve_one() -> tuple[bytes, list]:
        ident, *frames = sock.recv_multipart()
        h = requests.open(frames).header
        return ident, [bytes(f) for f in replies.seal({"ok": True, "r": h.counter}, h.sender,
                                                      h.counter).frames]

    try:
        first = c.submit("x")
        ident, reply1 = serve_one()
        sock.send_multipart([ident, *reply1])
        sock.send_multipart([ident, *reply1])       # the same reply again
        assert c.result(first) == first
        second = c.submit("y")
        ident, reply2 = serve_one()
        sock.send_multipart([ident, *reply1])       # an old reply, to the new request
        sock.send_multipart([ident, *reply2])
        assert c.result(second) == second           # answered by its own reply only
        assert c.drops.replayed == 2 and c.drops.total == 2
    finally:
        c.close()
        sock.close(0)


def test_messages_on_the_wrong_channel_are_dropped(codec, server):
    puller = StreamPuller(codec, "127.0.0.1")
    push = _raw(zmq.PUSH, puller.address)
    ping = _request(codec, puller.address, "add", a=1, b=2)  # a request, pushed into a stream
    push.send_multipart(ping)
    stream_msg = [bytes(f) for f in Sender(codec, Channel.STREAM).seal(
        {"m": "add", "a": {"a": 1, "b": 2}}, recipient_id(server.address)).frames]
    raw = _raw(zmq.DEALER, server.address)
    raw.send_multipart(stream_msg)                          # a stream message, as a request
    deadline = time.time() + 10  # (counted as the puller receives: the push may come late)
    while puller.drops.misdirected < 1 and time.time() < deadline:
        assert puller.recv(0.1) is None
    _wait_drops(server, 1)
    assert puller.drops.misdirected == 1 and server.drops.misdirected == 1
    assert not raw.poll(100)
    for s in (push, raw):
        s.close(0)
    puller.close()


def test_a_stream_drops_messages_of_the_wrong_schema(codec):
    def problem(msg) -> str | None:
        return None if isinstance(msg, dict) and isinstance(msg.get("seq"), int) else "no seq"

    puller = StreamPuller(codec, "127.0.0.1", validate=problem)
    pusher = StreamPusher(codec, puller.address)
    for msg in ({"m": "ping"}, [1, 2], {"seq": "1"}, {"seq": 1}):
        pusher.send(msg)
    assert puller.recv(5) == {"seq": 1}
    assert puller.drops.malformed == 3 and puller.drops.total == 3
    pusher.close()
    puller.close()


def test_frames_over_the_limit_are_cut_by_zeromq(codec, server):
    """A frame larger than the limit never reaches the handler (ZeroMQ drops the connection
    when it reads the frame's length); the largest message that fits still passes."""
    c = RpcClient(codec, server.address, timeout=5)
    fits = np.ones((1 << 20) - 200, np.uint8)
    assert c.call("sum", x=fits) == fits.size
    with pytest.raises(WireError):
        c.submit("sum", x=np.ones(1 << 20, np.uint8))    # refused by the sender
    raw = _raw(zmq.DEALER, server.address)
    raw.send_multipart([b"x" * (3 << 20)])               # over the limit, under 4x the limit
    time.sleep(0.3)
    assert c.call("add", a=1, b=1) == 2 and server.drops.total == 0
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
    raw = _raw(zmq.PUSH, puller.address)
    raw.send_multipart([b"j" * 80, b"junk"])
    good = StreamPusher(codec, puller.address)
    good.send({"ok": 1})
    assert puller.recv(5) == {"ok": 1}
    deadline = time.time() + 5  # the two connections' messages may arrive in either order
    while puller.drops.unauthenticated < 1 and time.time() < deadline:
        puller.recv(0.05)
    assert puller.drops.as_dict() == {"malformed": 0, "unauthenticated": 1, "oversized": 0,
                                      "replayed": 0, "misdirected": 0}
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


def test_closing_answers_a_deferred_call_still_running(codec):
    """A server closed while a deferred call runs (a model worker stopped during a training
    step) answers it with an error at once: its caller (the master) does not wait out its
    timeout. The call completing afterwards touches nothing: its wake-up pipe is closed, and
    that descriptor's number may already name another file."""
    from concurrent.futures import Future
    import os

    running: Future = Future()
    done: Future = Future()
    srv = RpcServer(codec, "127.0.0.1", {"train": lambda: running, "quick": lambda: done})
    stop = threading.Event()
    t = threading.Thread(target=srv.serve_forever, args=(stop, 0.02), daemon=True)
    t.start()
    c = RpcClient(codec, srv.address, 30.0)
    try:
        slow, quick = c.submit("train"), c.submit("quick")
        wait_until = time.monotonic() + 5
        while srv.pending < 2 and time.monotonic() < wait_until:
            time.sleep(0.01)
        assert srv.pending == 2
        stop.set()
        t.join()
        done.set_result("finished before the close")
        srv.close()
        assert c.result(quick, 5.0) == "finished before the close"
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="WorkerStopped.*train: the server stopped"):
            c.result(slow, 5.0)
        assert time.monotonic() - t0 < 2.0 and srv.pending == 0
        r, w = os.pipe()  # (likely the numbers the server's pipe had)
        try:
            running.set_result("too late")  # its callback must not write anywhere
            os.set_blocking(r, False)
            with pytest.raises(BlockingIOError):
                os.read(r, 1)
        finally:
            os.close(r)
            os.close(w)
    finally:
        c.close()
        srv.close()


def test_a_reply_whose_caller_is_gone_is_dropped_and_counted(codec):
    """A deferred call that completes after its caller closed (a master restarted while a
    training step ran) has nobody to answer: the reply is dropped and counted in ``unsent``,
    the send does not block, and the server goes on answering others."""
    from concurrent.futures import Future

    running: Future = Future()
    srv = RpcServer(codec, "127.0.0.1", {"train": lambda: running, "add": lambda a, b: a + b})
    monitor = srv._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    stop = threading.Event()
    t = threading.Thread(target=srv.serve_forever, args=(stop, 0.02), daemon=True)
    t.start()
    gone, other = RpcClient(codec, srv.address, 5.0), RpcClient(codec, srv.address, 5.0)
    try:
        gone.submit("train")
        wait_until = time.monotonic() + 5
        while srv.pending < 1 and time.monotonic() < wait_until:
            time.sleep(0.01)
        gone.close()
        assert monitor.poll(5000), "the server never saw its caller go"
        time.sleep(0.2)  # (the event comes as the pipe is torn down, not after)
        running.set_result("nobody reads this")
        assert other.call("add", a=1, b=2) == 3
        assert srv.unsent == 1 and srv.served == 2 and srv.pending == 0
    finally:
        other.close()
        stop.set()
        t.join()
        srv._sock.disable_monitor()
        monitor.close(linger=0)
        srv.close()


def test_curve_connections_need_the_trial_secret():
    """With CURVE a peer without the secret cannot complete the handshake: nothing it sends
    reaches the server (not even to be counted); peers with the secret talk as before."""
    secret = new_secret()
    codec = Codec(secret, 1 << 20, curve=True)
    srv = RpcServer(codec, "127.0.0.1", {"add": lambda a, b: a + b})
    puller = StreamPuller(codec, "127.0.0.1")
    stop = threading.Event()
    t = threading.Thread(target=srv.serve_forever, args=(stop, 0.02), daemon=True)
    t.start()
    plain = _raw(zmq.DEALER, srv.address)                         # no CURVE at all
    for frames in (_request(codec, srv.address, "add", a=1, b=2), [b""] * 100_000):
        try:  # its connection is cut at the handshake: there may be none to queue on
            plain.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass
    stranger = RpcClient(Codec(new_secret(), 1 << 20, curve=True), srv.address, timeout=0.5)
    try:
        with pytest.raises(RpcTimeout):                           # other keys: no handshake
            stranger.call("add", a=1, b=2)
        c = RpcClient(codec, srv.address, timeout=5)
        assert c.call("add", a=2, b=3) == 5 and c.call("add", a=np.ones(3), b=1).sum() == 6
        pusher = StreamPusher(codec, puller.address)
        pusher.send({"t": np.arange(5)})
        assert puller.recv(5)["t"].tolist() == [0, 1, 2, 3, 4]
        assert srv.drops.total == 0 and srv.served == 2           # the others never got in
        c.close()
        pusher.close()
    finally:
        stop.set()
        t.join()
        for s in (srv, puller, stranger):
            s.close()
        plain.close(0)
