"""Frame attacks, replays and connection floods against the workers of a live trial
(:class:`~tests.fuzzing.trial.LiveTrial`), each judged from the workers' drop counters.

A round sends a batch of bad messages to one target (a worker's RPC socket, or the master's
trajectory stream), waits until the target's counters have risen by as many, and checks:

- the counters rose by exactly the batch, under the expected reasons: dropped_and_counted;
- a reply came back, or the counters rose by less than was sent: wrongly_accepted;
- the target stopped answering a legitimate ping: crashed (the batch counts as one input, and
  the target is attacked no more);
- anything else (wrong reason, counted twice): miscounted.
"""
from __future__ import annotations

import collections
import os
import random
import resource
import socket
import time
from typing import Callable

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from system.errors import RpcError
from system.rpc import RpcClient
from system.sockets import endpoint
from system.wire import Channel
from tests.fuzzing import Budget, Tally
from tests.fuzzing.frames import GENERATORS, Bad, Forger, cut_frame
from tests.fuzzing.trial import LiveTrial

BATCH = 32
"""Most bad messages in one round."""
SETTLE_S = 8.0
"""Seconds a target has to count a batch."""
FLOOD = 300
"""Most connections in one flood round."""
FD_SLACK = 8
"""Descriptors a worker may hold above its count before a flood (its own clients come and go)."""


class Attacker:
    """Raw sockets (no authentication of their own) and forgers for each target of a trial."""

    def __init__(self, trial: LiveTrial) -> None:
        self.trial = trial
        self._socks: dict[str, zmq.Socket] = {}
        self._forgers: dict[str, Forger] = {}

    def forger(self, name: str) -> Forger:
        if name not in self._forgers:
            channel = Channel.STREAM if name == "stream" else Channel.REQUEST
            self._forgers[name] = Forger(self.trial.codec, self.trial.addresses[name], channel,
                                         router=name != "stream")
        return self._forgers[name]

    def socket(self, name: str) -> zmq.Socket:
        if name not in self._socks:
            self._socks[name] = raw_socket(zmq.PUSH if name == "stream" else zmq.DEALER,
                                           self.trial.addresses[name])
        return self._socks[name]

    def replies(self, name: str) -> int:
        """Messages that came back on ``name``'s socket (none may: all it sent was bad)."""
        sock, n = self.socket(name), 0
        while name != "stream" and sock.poll(0):
            sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks.clear()


def raw_socket(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(SETTLE_S * 1000))  # a target that stopped reading
    sock.connect(endpoint(address))
    return sock


def _settle(trial: LiveTrial, name: str, before: dict[str, int], n: int
            ) -> dict[str, int] | None:
    """How much ``name``'s counters rose once they account for ``n`` more drops (or after
    :data:`SETTLE_S`); None if it no longer answers."""
    deadline = time.monotonic() + SETTLE_S
    try:
        while True:
            now = trial.drops(name)
            delta = {k: v - before.get(k, 0) for k, v in now.items()}
            if sum(delta.values()) >= n or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        while True:  # until two reads agree: anything counted twice (or late) shows now
            time.sleep(0.05)
            again = trial.drops(name)
            if again == now or time.monotonic() > deadline + SETTLE_S:
                break
            now = again
    except RpcError:
        return None
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def _judge(tally: Tally, name: str, bads: list[Bad], got: dict[str, int],
           replies: int) -> None:
    n = len(bads)
    want = (collections.Counter({"total": n}) if name == "stream"
            else collections.Counter(b.reason for b in bads))
    total = sum(got.values())
    matched = sum(min(got.get(r, 0), c) for r, c in want.items())
    wrong = min(n, max(n - total, replies))
    ok = max(0, min(matched, n - wrong) - max(0, total - n))
    tally.tried += n
    tally.dropped_and_counted += ok
    tally.wrongly_accepted += wrong
    tally.miscounted += n - wrong - ok
    if ok != n:
        kinds = sorted({b.kind for b in bads})
        tally.note(f"{name}: sent {dict(want)}, counted {got}, {replies} replies ({kinds})")


def send_and_judge(trial: LiveTrial, attacker: Attacker, tally: Tally,
                   sends: list[tuple[str, Bad]]) -> bool:
    """Send every ``(target, bad message)``, then judge each target's counters; False (and a
    crash counted) if a target stopped answering."""
    by_target: dict[str, list[Bad]] = collections.defaultdict(list)
    for name, bad in sends:
        by_target[name].append(bad)
    try:
        before = {name: trial.drops(name) for name in by_target}
        for name, bad in sends:
            attacker.socket(name).send_multipart(bad.frames)
    except (RpcError, zmq.Again) as e:
        return _crashed(tally, sorted(by_target), f"{type(e).__name__}: {e}")
    for name, bads in by_target.items():
        got = _settle(trial, name, before[name], len(bads))
        if got is None or not trial.alive(name):
            return _crashed(tally, [name], f"after {sorted({b.kind for b in bads})}")
        _judge(tally, name, bads, got, attacker.replies(name))
        trial.observed[name] = trial.observed.get(name, 0) + sum(got.values())
    return True


def _crashed(tally: Tally, names: list[str], detail: str) -> bool:
    tally.tried += 1
    tally.crashed += 1
    tally.note(f"{', '.join(names)} stopped answering: {detail}")
    return False


def _window_open(trial: LiveTrial, tally: Tally) -> bool:
    if time.monotonic() < trial.attack_until:
        return True
    tally.note("stopped early: the trial's attack window ended")
    return False


def frame_attack(trial: LiveTrial, attacker: Attacker, target: str, rng: random.Random,
                 budget: Budget) -> Tally:
    """Batches of one generator's messages (:data:`~tests.fuzzing.frames.GENERATORS`) at
    random targets (every worker and the stream); ``oversized`` also sends single frames
    over ZeroMQ's limit, each on a fresh connection."""
    tally, gen = Tally(target), GENERATORS[target]
    names = [*trial.workers, "stream"]
    for left in budget.rounds(tally):
        if not _window_open(trial, tally):
            break
        name = rng.choice(names)
        if target == "oversized" and rng.random() < 0.2:
            _cut_round(trial, attacker, tally, rng, name)
            continue
        f = attacker.forger(name)
        batch = [(name, gen(rng, f)) for _ in range(min(left, rng.randint(1, BATCH)))]
        if not send_and_judge(trial, attacker, tally, batch):
            break
    return tally


def _cut_round(trial: LiveTrial, attacker: Attacker, tally: Tally, rng: random.Random,
               name: str) -> None:
    """One frame over ``MAXMSGSIZE``: libzmq must cut the connection (seen by our socket's
    monitor) before buffering it, and nothing is counted."""
    sock = raw_socket(zmq.PUSH if name == "stream" else zmq.DEALER, trial.addresses[name])
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        before = trial.drops(name)
        sock.send(cut_frame(rng, attacker.forger(name)), copy=False)
        cut = bool(monitor.poll(int(SETTLE_S * 1000))) and recv_monitor_message(
            monitor)["event"] == zmq.EVENT_DISCONNECTED
        after = trial.drops(name)
    except (RpcError, zmq.Again) as e:
        _crashed(tally, [name], f"after a frame over the limit: {e}")
        return
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    tally.tried += 1
    if cut and after == before:
        tally.dropped_and_counted += 1
    elif cut:
        tally.miscounted += 1
        tally.note(f"{name}: a frame over the limit was cut but counted: {before} -> {after}")
    else:
        tally.wrongly_accepted += 1
        tally.note(f"{name}: a frame over the limit was not cut")


def _echo_count(trial: LiveTrial, name: str) -> int:
    """Calls ``name`` has served that have an effect (generation: ``echo``; others: none)."""
    if not name.startswith("generation/"):
        return 0
    client = RpcClient(trial.codec, trial.addresses[name], SETTLE_S)
    try:
        return int(client.call("echo", tokens=np.arange(3))["requests"])
    finally:
        client.close()


def _capture(trial: LiveTrial, name: str, rng: random.Random) -> tuple[list[bytes], list[bytes]]:
    """A legitimate call to ``name`` as a sniffer records it: the request and its reply."""
    forger = Forger(trial.codec, trial.addresses[name], Channel.REQUEST, router=True)
    payload = ({"m": "echo", "a": {"tokens": np.arange(rng.randint(1, 64))}}
               if name.startswith("generation/") else {"m": "ping", "a": {}})
    request = forger.seal(payload)
    sock = raw_socket(zmq.DEALER, trial.addresses[name])
    try:
        sock.send_multipart(request)
        if not sock.poll(int(SETTLE_S * 1000)):
            raise RpcError(f"{name} did not answer a legitimate call")
        return request, sock.recv_multipart()
    finally:
        sock.close(0)


def replay_attack(trial: LiveTrial, attacker: Attacker, rng: random.Random,
                  budget: Budget) -> Tally:
    """Capture a legitimate call, then send it again: to the same worker (``replayed``), to
    another worker or into the stream (``misdirected``); and send its reply back as a request
    (``misdirected``). A generation worker's echo count must show only the legitimate calls."""
    tally = Tally("replayed")
    for left in budget.rounds(tally):
        if not _window_open(trial, tally):
            break
        name = rng.choice(trial.workers)
        others = [w for w in trial.workers if w != name]
        try:
            served = _echo_count(trial, name)
            request, reply = _capture(trial, name, rng)
        except RpcError as e:
            _crashed(tally, [name], str(e))
            break
        sends = []
        for _ in range(min(left, rng.randint(1, 8))):
            pick = rng.random()
            to, frames, reason = ((name, request, "replayed") if pick < 0.4 else
                                  (rng.choice(others), request, "misdirected") if pick < 0.7 else
                                  ("stream", request, "misdirected") if pick < 0.85 else
                                  (name, reply, "misdirected"))
            sends.append((to, Bad(frames, reason, f"replay to {to}: {reason}")))
        if not send_and_judge(trial, attacker, tally, sends):
            break
        extra = _echo_count(trial, name) - served - 2 if name.startswith("generation/") else 0
        if extra > 0:  # echo calls served beyond ours: replays that took effect
            extra = min(extra, tally.dropped_and_counted)
            tally.wrongly_accepted += extra
            tally.dropped_and_counted -= extra
            tally.note(f"{name} served {extra} replayed echo request(s)")
    return tally


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


_GREETING = b"\xff" + b"\0" * 8 + b"\x7f"


def _flood_bytes(rng: random.Random) -> bytes:
    """What one flood connection sends: nothing, a greeting it never finishes, a bad greeting,
    or garbage (which libzmq may read as ZMTP 1.0 frames, each then dropped and counted)."""
    return rng.choice([b"", _GREETING, _GREETING + b"\x03\x00NULL" + b"\0" * 16,
                       b"\xff" + rng.randbytes(rng.randint(1, 100)),
                       rng.randbytes(rng.randint(1, 400))])


def _open_flood(host: str, port: int, n: int, rng: random.Random) -> list[socket.socket]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port), timeout=5)
        socks.append(s)
        try:
            s.sendall(_flood_bytes(rng))
        except OSError:
            pass  # already cut: a bad greeting
    return socks


def flood_attack(trial: LiveTrial, rng: random.Random, budget: Budget) -> Tally:
    """Rounds of up to :data:`FLOOD` raw TCP connections to one worker: it must answer a
    legitimate ping while they are open, and release every one once they close (its
    descriptors come back). dropped_and_counted: connections released; what garbage they
    delivered is counted by the worker (added to the trial's observed drops)."""
    tally = Tally("flood")
    for left in budget.rounds(tally):
        if not _window_open(trial, tally):
            break
        name = rng.choice(trial.workers)
        host, port = endpoint(trial.addresses[name])[len("tcp://"):].rsplit(":", 1)
        try:
            pid, before = trial.pid(name), trial.drops(name)
            base = _fds(pid)
            socks = _open_flood(host, int(port), min(left, rng.randint(50, FLOOD)), rng)
            trial.ping(name)  # served meanwhile
        except (RpcError, OSError) as e:
            _crashed(tally, [name], f"during a flood: {type(e).__name__}: {e}")
            break
        for s in socks:
            s.close()
        leaked = _released(pid, base)
        got = _settle(trial, name, before, 0)
        if got is None:
            _crashed(tally, [name], "after a flood")
            break
        trial.observed[name] = trial.observed.get(name, 0) + sum(got.values())
        tally.tried += len(socks)
        tally.dropped_and_counted += len(socks) - leaked
        tally.wrongly_accepted += leaked
        if leaked:
            tally.note(f"{name} still holds {leaked} descriptors of closed connections")
    return tally


def _released(pid: int, base: int, timeout: float = 10.0) -> int:
    """Descriptors above ``base`` + slack that ``pid`` still holds after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _fds(pid) <= base + FD_SLACK:
            return 0
        time.sleep(0.1)
    return max(0, _fds(pid) - base - FD_SLACK)


ATTACKS: dict[str, Callable[[LiveTrial, Attacker, random.Random, Budget], Tally]] = {
    **{name: (lambda t, a, r, b, name=name: frame_attack(t, a, name, r, b))
       for name in GENERATORS},
    "replayed": replay_attack,
    "flood": lambda t, a, r, b: flood_attack(t, r, b),
}
"""Every wire target by name, in the order they run."""
