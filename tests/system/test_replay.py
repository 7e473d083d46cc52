"""Replay windows and reply binding, message by message (sockets: tests/system/test_rpc.py)."""
from __future__ import annotations

import struct
import time

import pytest

from system.replay import WINDOW, LateReply, Receiver, ReplyReceiver, Sender
from system.wire import Channel, Codec, DroppedMessage, new_secret

ADDRESS = "tcp://127.0.0.1:5000#00aa"


@pytest.fixture
def codec():
    return Codec(new_secret(), max_message_bytes=1 << 20)


def _reason(receiver, frames) -> str:
    with pytest.raises(DroppedMessage) as e:
        receiver.open(frames)
    return e.value.reason


def test_each_message_is_accepted_once(codec):
    rx = Receiver(codec, Channel.STREAM, ADDRESS)
    tx = Sender(codec, Channel.STREAM)
    msgs = [tx.seal({"i": i}, rx.identity).frames for i in range(5)]
    assert [rx.open(m).payload["i"] for m in msgs] == list(range(5))
    assert all(_reason(rx, m) == "replayed" for m in msgs)


def test_out_of_order_within_the_window_and_too_old(codec):
    rx = Receiver(codec, Channel.STREAM, ADDRESS)
    tx = Sender(codec, Channel.STREAM)
    msgs = [tx.seal(i, rx.identity).frames for i in range(WINDOW + 10)]
    assert rx.open(msgs[5]).payload == 5
    assert rx.open(msgs[2]).payload == 2          # late but in the window: once
    assert _reason(rx, msgs[2]) == "replayed"
    assert rx.open(msgs[WINDOW + 9]).payload == WINDOW + 9
    assert _reason(rx, msgs[3]) == "replayed"     # fell out of the window: refused
    assert rx.open(msgs[WINDOW + 1]).payload == WINDOW + 1


def test_wrong_recipient_or_channel_is_misdirected(codec):
    rx = Receiver(codec, Channel.REQUEST, ADDRESS)
    other = Receiver(codec, Channel.REQUEST, "tcp://127.0.0.1:5000#00bb")  # same port, restarted
    req = Sender(codec, Channel.REQUEST).seal({"m": "ping"}, rx.identity).frames
    assert _reason(other, req) == "misdirected"
    stream = Sender(codec, Channel.STREAM).seal({"m": "ping"}, rx.identity).frames
    assert _reason(rx, stream) == "misdirected"
    assert rx.open(req).payload == {"m": "ping"}  # neither counted against the real one


def test_a_new_sender_may_start_again_at_one(codec):
    rx = Receiver(codec, Channel.STREAM, ADDRESS)
    for _ in range(3):  # a restarted process: new senders, counters from 1
        assert rx.open(Sender(codec, Channel.STREAM).seal("x", rx.identity).frames).payload == "x"
    assert rx.senders == 3


def test_senders_are_bounded_and_forgetting_does_not_reopen_replays(codec):
    rx = Receiver(codec, Channel.STREAM, ADDRESS, max_senders=4)
    senders = [Sender(codec, Channel.STREAM) for _ in range(6)]
    first = [s.seal("a", rx.identity).frames for s in senders]
    for f in first:
        rx.open(f)
        time.sleep(0.001)  # distinct creation times
    assert rx.senders == 4
    assert _reason(rx, first[0]) == "replayed"  # forgotten, and older than the newest forgotten
    assert _reason(rx, first[5]) == "replayed"  # remembered
    assert rx.open(Sender(codec, Channel.STREAM).seal("b", rx.identity).frames).payload == "b"
    stale = Sender(codec, Channel.STREAM)
    stale.id = struct.pack(">Q", 1) + stale.id[8:]  # claims to predate the forgotten ones
    assert _reason(rx, stale.seal("c", rx.identity).frames) == "replayed"


def test_replies_are_bound_to_their_request(codec):
    client = Sender(codec, Channel.REQUEST)
    replies = ReplyReceiver(codec, client)
    server = Sender(codec, Channel.REPLY)
    n1 = client.seal({"m": "a"}, b"s" * 16).counter
    n2 = client.seal({"m": "b"}, b"s" * 16).counter
    replies.expect(n1)
    replies.expect(n2)
    r1 = server.seal({"ok": True, "r": 1}, client.id, n1).frames
    assert replies.open(r1).header.reply_to == n1
    with pytest.raises(DroppedMessage, match="replayed"):
        replies.open(r1)                                  # a replay of the reply
    other = Sender(codec, Channel.REQUEST)
    with pytest.raises(DroppedMessage, match="misdirected"):  # for another client
        replies.open(server.seal({"ok": True}, other.id, n2).frames)
    with pytest.raises(DroppedMessage, match="misdirected"):  # not a reply at all
        replies.open(Sender(codec, Channel.STREAM).seal({"ok": True}, client.id, n2).frames)
    replies.abandon(n2)
    with pytest.raises(LateReply):                        # late, not an attack: not counted
        replies.open(server.seal({"ok": True}, client.id, n2).frames)
    with pytest.raises(DroppedMessage, match="replayed"):
        replies.open(server.seal({"ok": True}, client.id, n2).frames)
