"""Bad ZeroMQ messages (pure): each generator returns the frames a hostile peer sends and the
reason (a :class:`~system.wire.DropCounters` field) the receiver must count them under.

Forged messages (truncated, bit-flipped, signed bombs) start as a worker would send them, built
here with the trial secret: a sniffer records the same bytes, and a peer that holds the secret
reaches the parser. The expected reason follows the receiver's checks in their order
(:func:`expected`), not the receiver's own code.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import random
import struct
import time
from typing import Any, Callable

import msgpack
import numpy as np

from system.replay import Sender
from system.sockets import MAX_FRAMES
from system.wire import OVERHEAD_BYTES, Channel, Codec, Header, new_secret, recipient_id


@dataclasses.dataclass
class Bad:
    """One hostile message and the drop reason it must be counted under."""

    frames: list[bytes]
    reason: str
    kind: str
    """What it is, for the report."""


class Forger:
    """Builds messages for ``address`` on ``channel`` the way a holder of ``codec``'s secret
    would (new sender id, counters from 1)."""

    def __init__(self, codec: Codec, address: str, channel: Channel, router: bool) -> None:
        self.codec, self.address, self.channel = codec, address, channel
        self.router = router
        """The receiver is a ROUTER (it sees one more frame: the peer's identity)."""
        self.recipient = recipient_id(address)
        self._sender = Sender(codec, channel)
        self._raw_id = struct.pack(">Q", time.time_ns() // 1000) + os.urandom(8)
        self._raw_counter = itertools.count(1)

    @property
    def limit(self) -> int:
        return self.codec.max_message_bytes

    def seal(self, payload: Any) -> list[bytes]:
        """``payload`` sealed as a legitimate sender would."""
        return [bytes(f) for f in self._sender.seal(payload, self.recipient).frames]

    def sign_raw(self, body: bytes, buffers: list[bytes] | None = None) -> list[bytes]:
        """``body`` (any bytes, valid msgpack or not) and ``buffers`` with a valid tag: what a
        peer holding the secret can make a receiver parse."""
        head = Header(self.channel, self._raw_id, next(self._raw_counter),
                      self.recipient).pack()
        frames = [memoryview(body), *(memoryview(b) for b in buffers or [])]
        tag = self.codec._tag(head, frames)  # the wire's MAC, as Codec.encode applies it
        return [head + tag + body, *(buffers or [])]

    def expected(self, frames: list[bytes], authentic: bool = False,
                 then: str = "malformed") -> str:
        """The reason a receiver drops ``frames`` under: its checks in order (frame count,
        a header, size, tag), then ``then`` for an authentic message."""
        if len(frames) + self.router > MAX_FRAMES:
            return "oversized"
        if not frames or len(frames[0]) < OVERHEAD_BYTES:
            return "malformed"
        if sum(len(f) for f in frames) - OVERHEAD_BYTES > self.limit:
            return "oversized"
        return then if authentic else "unauthenticated"


Generator = Callable[[random.Random, Forger], Bad]


def _size(rng: random.Random) -> int:
    return rng.choice([0, 1, rng.randint(0, OVERHEAD_BYTES + 2), rng.randint(0, 512),
                       rng.randint(0, 4096)])


def _legit(rng: random.Random, f: Forger) -> list[bytes]:
    """A message a worker could send (a request, or a stream message), sometimes with tensors."""
    tokens = np.arange(rng.randint(0, 64), dtype=rng.choice([np.int32, np.int64, np.float32]))
    payload: Any = rng.choice([{"m": "ping", "a": {}}, {"m": "echo", "a": {"tokens": tokens}},
                               {"worker": 0, "seq": rng.randint(0, 99), "tokens": tokens}])
    return f.seal(payload)


def random_bytes(rng: random.Random, f: Forger) -> Bad:
    """1 to 5 frames of random bytes (sometimes many more)."""
    n = rng.choice([1, 1, 2, 3, 5, rng.randint(1, 300)])
    frames = [rng.randbytes(_size(rng)) for _ in range(n)]
    return Bad(frames, f.expected(frames), f"random x{n}")


def truncated(rng: random.Random, f: Forger) -> Bad:
    """A legitimate message cut short: one frame cut at a random point, or frames dropped."""
    frames = _legit(rng, f)
    if len(frames) > 1 and rng.random() < 0.3:
        frames = frames[:rng.randint(1, len(frames) - 1)]
        return Bad(frames, f.expected(frames), "frames dropped")
    i = rng.choice([j for j, x in enumerate(frames) if x])
    frames[i] = frames[i][:rng.randrange(len(frames[i]))]
    return Bad(frames, f.expected(frames), f"frame {i} cut to {len(frames[i])}")


def wrong_key(rng: random.Random, f: Forger) -> Bad:
    """A well-formed message sealed under another trial's secret."""
    other = Forger(Codec(new_secret(), f.limit), f.address, f.channel, f.router)
    frames = _legit(rng, other)
    return Bad(frames, f.expected(frames), "other secret")


def bitflip(rng: random.Random, f: Forger) -> Bad:
    """A legitimate message with 1 to 8 bits flipped anywhere (header, tag, body, tensors)."""
    frames = [bytearray(x) for x in _legit(rng, f)]
    flips = rng.randint(1, 8)
    bits: set[tuple[int, int, int]] = set()  # distinct: two flips of one bit would cancel
    while len(bits) < flips:
        i = rng.choice([j for j, x in enumerate(frames) if x])
        bits.add((i, rng.randrange(len(frames[i])), rng.randrange(8)))
    for i, k, b in bits:
        frames[i][k] ^= 1 << b
    out = [bytes(x) for x in frames]
    return Bad(out, f.expected(out), f"{flips} bits flipped")


_REQUEST_PREFIX = b"\x82\xa1m\xa4ping\xa1a"  # {"m": "ping", "a": <what follows>}


def _bomb_body(rng: random.Random) -> tuple[bytes, str]:
    """Bytes that are not a valid request: nesting past msgpack's stack, declared lengths far
    beyond the data, truncated or trailing data."""
    depth = rng.choice([1100, 5000, 100_000])
    kinds: list[tuple[bytes, str]] = [
        (b"\x91" * depth + b"\xc0", f"array nesting {depth}"),
        (b"\x81\xc0" * depth + b"\xc0", f"map nesting {depth}"),
        (b"\xdd\xff\xff\xff\xff" + b"\xc0" * rng.randint(0, 64), "array of 2^32-1"),
        (b"\xdf\xff\xff\xff\xff" + b"\xc0" * rng.randint(0, 64), "map of 2^32-1"),
        (b"\xc6\xff\xff\xff\xff" + rng.randbytes(rng.randint(0, 64)), "bin of 2^32-1"),
        (b"\xdb\x7f\xff\xff\xff" + rng.randbytes(rng.randint(0, 64)), "str of 2^31-1"),
        (b"\xc9\xff\xff\xff\xff\x01" + rng.randbytes(rng.randint(0, 64)), "ext of 2^32-1"),
        (msgpack.packb({"m": "ping", "a": {}}) + rng.randbytes(rng.randint(1, 8)), "trailing"),
        (msgpack.packb({"m": "ping", "a": {"x": list(range(50))}})[:-rng.randint(1, 40)],
         "truncated msgpack"),
        (bytes([rng.choice([0xc1, 0xd4, 0xd8, 0xc7])]) + rng.randbytes(rng.randint(0, 8)),
         "reserved or short ext"),
    ]
    body, kind = rng.choice(kinds)
    if rng.random() < 0.4 and not kind.startswith(("trailing", "truncated")):
        body, kind = _REQUEST_PREFIX + body, f"request args: {kind}"
    return body, kind


def _tensor_record(rng: random.Random, n_buffers: int, nbytes: int) -> msgpack.ExtType:
    """A tensor record that does not describe its frame: unknown dtype, missing frame, or a
    shape that does not fill it exactly."""
    code = rng.choice([1, 2, rng.randint(3, 127)])
    dtype = rng.choice(["<i4", "int32", "object", "O", ">i4", "|V8", "float128", 7, None])
    if code in (1, 2) and dtype in ("<i4", "int32") and rng.random() < 0.7:
        index = rng.choice([0, n_buffers, -1, 2 ** 40]) if n_buffers else 0
        bad_fill = nbytes // 4 + rng.choice([1, 2, 2 ** 61])
        shape: Any = rng.choice([[bad_fill], [-1], [2 ** 64 - 1], [1] * 40, "x", [0.5]])
    else:  # unknown type or dtype; the shape would not fit either
        index, shape = 0, [nbytes + 1]
    return msgpack.ExtType(code, msgpack.packb([index, dtype, shape]))


def _bad_shapes(rng: random.Random) -> Any:
    """Authentic payloads that are neither a request {m: str, a: {str: ...}} nor a stream
    message of the expected schema."""
    arr = np.arange(rng.randint(0, 5))
    return rng.choice([
        None, 7, "ping", b"\x00", [], ["ping", {}], {}, {"a": {}}, {"m": "ping"},
        {"m": 5, "a": {}}, {"m": None, "a": {}}, {"m": b"ping", "a": {}},
        {"m": "ping", "a": None}, {"m": "ping", "a": []}, {"m": "ping", "a": 0},
        {"m": "ping", "a": ""}, {"m": "ping", "a": arr}, {"m": "ping", "a": {1: 2}},
        {"m": "ping", "a": {b"x": 1}}, {"m": "ping", "a": {None: 1}}, {"m": arr, "a": {}},
        {"worker": "0", "seq": 1}, {"worker": 0, "seq": 1, "tokens": [1, 2]}])


def bomb(rng: random.Random, f: Forger) -> Bad:
    """Signed msgpack bombs and bad payloads (they reach the parser), or a message of many
    tiny frames (unsigned)."""
    pick = rng.random()
    if pick < 0.35:
        body, kind = _bomb_body(rng)
        frames = f.sign_raw(body)
    elif pick < 0.55:
        buffers = [rng.randbytes(rng.choice([0, 3, 8, 64])) for _ in range(rng.randint(0, 2))]
        record = _tensor_record(rng, len(buffers), len(buffers[0]) if buffers else 0)
        payload = {"m": "echo", "a": {"tokens": record}} if rng.random() < 0.5 else record
        frames, kind = f.sign_raw(msgpack.packb(payload), buffers), "bad tensor record"
    elif pick < 0.85:
        shape = _bad_shapes(rng)
        frames, kind = f.seal(shape), f"bad payload {str(shape)[:40]}"
    else:
        n = rng.choice([1000, 10_000, 60_000])
        frames = [rng.randbytes(rng.choice([0, OVERHEAD_BYTES]))] + [b""] * (n - 1)
        return Bad(frames, f.expected(frames), f"{n} tiny frames")
    return Bad(frames, f.expected(frames, authentic=True), kind)


def oversized(rng: random.Random, f: Forger) -> Bad:
    """Frames each within ZeroMQ's limit but together over ``rpc.max_message_bytes``, or more
    than :data:`~system.sockets.MAX_FRAMES` frames."""
    if rng.random() < 0.25:
        n = MAX_FRAMES + rng.randint(0, 100)
        frames = [rng.randbytes(rng.choice([0, 100]))] + [b""] * (n - 1)
        return Bad(frames, f.expected(frames), f"{n} frames")
    parts = rng.randint(2, 4)
    size = min(f.limit // (parts - 1) + rng.randint(1, 1024), f.limit - 1)  # each fits ZeroMQ
    frames = [os.urandom(size) for _ in range(parts)]
    if rng.random() < 0.5:  # or as a real sender would have sealed it
        frames = f.sign_raw(frames[0], frames[1:])
    return Bad(frames, f.expected(frames, authentic=True), f"{parts} frames of {size}")


def cut_frame(rng: random.Random, f: Forger) -> bytes:
    """One frame over ZeroMQ's per-frame limit (``MAXMSGSIZE``): the connection is cut when
    its length is read; nothing is counted."""
    return os.urandom(f.limit + OVERHEAD_BYTES + 1 + rng.randint(0, 3 * f.limit))


GENERATORS: dict[str, Generator] = {"random": random_bytes, "truncated": truncated,
                                    "wrong_key": wrong_key, "bitflip": bitflip,
                                    "msgpack_bomb": bomb, "oversized": oversized}
"""The frame attacks by name (replays and floods need a live peer: :mod:`tests.fuzzing.wire`)."""
