"""Who sent a message, whether it was already received, and whether it is meant for us.

Every sending socket is a :class:`Sender`: a random id (its first 8 bytes are its creation time
in microseconds) and a counter that starts at 1 and never repeats, both in the authenticated
header (:class:`system.wire.Header`). A restarted process makes new senders, so a counter that
starts again at 1 is a new sender's, never a replay.

- :class:`Receiver` (a server's requests, a stream's messages) drops what is meant for another
  recipient or channel, and each sender's counters it has already seen: a sliding window of
  :data:`WINDOW` counters per sender (ZeroMQ keeps one socket's messages in order, so the window
  only needs slack), for at most ``max_senders`` senders; the least recently heard is forgotten
  first, and any sender created before the newest forgotten one is refused from then on, so
  forgetting never reopens a sender's old messages to a replay.
- :class:`ReplyReceiver` (a client) accepts exactly one reply per request in flight, bound to it
  by the request's counter; a reply to an abandoned (timed-out) call is :class:`LateReply`.
"""
from __future__ import annotations

import collections
import itertools
import os
import struct
import time
from typing import Any, NamedTuple, Sequence

from system.wire import Channel, Codec, DroppedMessage, Header, Message, recipient_id

WINDOW = 1024
"""Counters per sender below the highest seen that are still accepted (once)."""
MAX_SENDERS = 4096
"""Senders a receiver remembers by default (each costs a few hundred bytes)."""
_LATE_KEPT = 1024
_WINDOW_MASK = (1 << WINDOW) - 1


class Sealed(NamedTuple):
    counter: int
    frames: list[Any]


class Sender:
    """Numbers and seals the messages of one sending socket."""

    def __init__(self, codec: Codec, channel: Channel) -> None:
        self.codec = codec
        self.channel = channel
        self.id = struct.pack(">Q", time.time_ns() // 1000) + os.urandom(8)
        self._counter = itertools.count(1)  # next() is atomic under the GIL

    def seal(self, payload: Any, recipient: bytes, reply_to: int = 0) -> Sealed:
        """The frames of ``payload`` for ``recipient`` (raises :class:`~system.errors.WireError`
        if it cannot be encoded)."""
        n = next(self._counter)
        return Sealed(n, self.codec.encode(payload, Header(self.channel, self.id, n, recipient,
                                                           reply_to)))


def created_us(sender: bytes) -> int:
    """When a sender id was made (microseconds since the epoch, the sender's clock)."""
    return int.from_bytes(sender[:8], "big")


class Receiver:
    """The receiving side of requests or of a stream, at ``address``: see the module doc."""

    def __init__(self, codec: Codec, channel: Channel, address: str,
                 max_senders: int = MAX_SENDERS) -> None:
        self.codec = codec
        self.channel = channel
        self.identity = recipient_id(address)
        self.max_senders = max_senders
        self._senders: collections.OrderedDict[bytes, list[int]] = collections.OrderedDict()
        self._floor = -1  # creation time of the newest sender forgotten

    def open(self, frames: Sequence[Any]) -> Message:
        """Verify, check and decode (raises :class:`~system.wire.DroppedMessage`)."""
        return self.codec.decode(frames, self.admit)

    def admit(self, h: Header) -> None:
        if h.channel != self.channel:
            raise DroppedMessage("misdirected", f"{h.channel.name} on a {self.channel.name} "
                                 "socket")
        if h.recipient != self.identity:
            raise DroppedMessage("misdirected", "meant for another recipient")
        if h.counter < 1:
            raise DroppedMessage("malformed", "counter 0")
        state = self._senders.get(h.sender)
        if state is None:
            if created_us(h.sender) <= self._floor:
                raise DroppedMessage("replayed", "from a sender older than those remembered")
            state = self._senders[h.sender] = [0, 0]
            while len(self._senders) > self.max_senders:
                old, _ = self._senders.popitem(last=False)
                self._floor = max(self._floor, created_us(old))
        else:
            self._senders.move_to_end(h.sender)
        _accept(state, h.counter)

    @property
    def senders(self) -> int:
        return len(self._senders)


def _accept(state: list[int], counter: int) -> None:
    """Mark ``counter`` seen in ``state`` = [highest counter, bitmap of the window below it]."""
    high, bits = state
    if counter > high:
        shift = counter - high
        state[0] = counter
        state[1] = (((bits << shift) | 1) & _WINDOW_MASK) if shift < WINDOW else 1
        return
    offset = high - counter
    if offset >= WINDOW or (bits >> offset) & 1:
        raise DroppedMessage("replayed", f"counter {counter} already seen (highest {high})")
    state[1] = bits | (1 << offset)


class LateReply(DroppedMessage):
    """The reply to a call the client stopped waiting for: discarded, not counted."""

    def __init__(self, counter: int) -> None:
        super().__init__("late", f"reply to abandoned request {counter}")


class ReplyReceiver:
    """A client's replies: one per request in flight, bound to it (see the module doc)."""

    def __init__(self, codec: Codec, sender: Sender) -> None:
        self.codec = codec
        self.identity = sender.id
        self._expected: set[int] = set()
        self._late: collections.OrderedDict[int, None] = collections.OrderedDict()

    def expect(self, counter: int) -> None:
        self._expected.add(counter)

    def expecting(self, counter: int) -> bool:
        return counter in self._expected

    def abandon(self, counter: int) -> None:
        if counter in self._expected:
            self._expected.discard(counter)
            self._late[counter] = None
            while len(self._late) > _LATE_KEPT:
                self._late.popitem(last=False)

    def open(self, frames: Sequence[Any]) -> Message:
        return self.codec.decode(frames, self.admit)

    def admit(self, h: Header) -> None:
        if h.channel != Channel.REPLY:
            raise DroppedMessage("misdirected", f"{h.channel.name} on a client socket")
        if h.recipient != self.identity:
            raise DroppedMessage("misdirected", "a reply meant for another client")
        if h.reply_to in self._expected:
            self._expected.discard(h.reply_to)
            return
        if h.reply_to in self._late:
            del self._late[h.reply_to]
            raise LateReply(h.reply_to)
        raise DroppedMessage("replayed", f"reply to request {h.reply_to}, which is not "
                             "in flight")


__all__ = ["LateReply", "MAX_SENDERS", "ReplyReceiver", "Receiver", "Sealed", "Sender", "WINDOW"]
