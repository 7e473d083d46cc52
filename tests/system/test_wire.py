"""The wire format: round trips with dtype and shape, and every kind of bad frame dropped."""
from __future__ import annotations

import resource

import msgpack
import numpy as np
import pytest
import torch

from system.errors import WireError
from system.wire import (HEADER_BYTES, OVERHEAD_BYTES, Channel, Codec, DroppedMessage, Header,
                         new_secret)

HEADER = Header(Channel.STREAM, b"s" * 16, 1, b"r" * 16)


@pytest.fixture
def codec():
    return Codec(new_secret(), max_message_bytes=1 << 20)


def admit_all(header: Header) -> None:
    pass


def encode(codec, payload, header=HEADER):
    return codec.encode(payload, header)


def decode(codec, frames):
    return codec.decode(frames, admit_all).payload


def roundtrip(codec, payload):
    return decode(codec, [bytes(f) for f in encode(codec, payload)])


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "float16", "float32",
                                   "float64", "bool", "complex64"])
def test_numpy_roundtrip(codec, dtype):
    a = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
    out = roundtrip(codec, {"a": a})["a"]
    assert out.dtype == a.dtype and out.shape == a.shape and np.array_equal(out, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.uint8])
def test_torch_roundtrip(codec, dtype):
    t = torch.arange(30).reshape(5, 6).to(dtype)
    out = roundtrip(codec, [t])[0]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_nested_empty_scalar_and_noncontiguous(codec):
    base = np.arange(20, dtype=np.float32).reshape(4, 5)
    payload = {"x": [1, 2.5, "s", b"bytes", None, True, {"k": np.float32(1.5)}],
               "empty": np.zeros((0, 3), np.int16), "t0": torch.zeros(0),
               "view": base[:, ::2], "tview": torch.arange(12).reshape(3, 4).t(),
               "scalar": torch.tensor(3.0)}
    out = roundtrip(codec, payload)
    assert out["x"] == [1, 2.5, "s", b"bytes", None, True, {"k": 1.5}]
    assert out["empty"].shape == (0, 3) and out["empty"].dtype == np.int16
    assert out["t0"].shape == (0,)
    assert np.array_equal(out["view"], base[:, ::2])
    assert torch.equal(out["tview"], torch.arange(12).reshape(3, 4).t())
    assert out["scalar"].shape == () and float(out["scalar"]) == 3.0


def test_tensors_are_separate_frames(codec):
    a = np.ones(1000, np.float64)
    frames = encode(codec, {"a": a, "b": torch.ones(10)})
    assert len(frames) == 3 and frames[1].nbytes == 8000 and frames[2].nbytes == 40


def test_objects_that_need_pickle_are_refused(codec):
    with pytest.raises(WireError):
        encode(codec, {"f": object()})
    with pytest.raises(WireError):
        encode(codec, np.array([object()], dtype=object))
    with pytest.raises(WireError, match="cannot be sent"):  # not on the allow-list either
        encode(codec, np.array(["text"]))


def _reason(codec, frames):
    with pytest.raises(DroppedMessage) as e:
        codec.decode(frames, admit_all)
    return e.value.reason


def test_tampering_is_detected(codec):
    frames = [bytearray(bytes(f)) for f in encode(codec, {"a": np.arange(100)})]
    for i in range(len(frames)):
        bad = [bytes(f) for f in frames]
        b = bytearray(bad[i])
        b[len(b) // 2] ^= 1
        bad[i] = bytes(b)
        assert _reason(codec, bad) == "unauthenticated"


def test_reordered_dropped_and_extra_frames(codec):
    frames = [bytes(f) for f in encode(codec, {"a": np.arange(4), "b": np.arange(5)})]
    assert _reason(codec, [frames[0], frames[2], frames[1]]) == "unauthenticated"
    assert _reason(codec, frames[:-1]) == "unauthenticated"
    assert _reason(codec, frames + [b"x"]) == "unauthenticated"


def test_wrong_secret(codec):
    other = Codec(new_secret())
    assert _reason(codec, [bytes(f) for f in encode(other, {"x": 1})]) == "unauthenticated"


def test_truncated_and_garbage(codec):
    assert _reason(codec, []) == "malformed"
    assert _reason(codec, [b"only one"]) == "malformed"
    assert _reason(codec, [b"short", b"header"]) == "malformed"
    assert _reason(codec, [b"\0" * OVERHEAD_BYTES + b"\xc1garbage"]) == "unauthenticated"
    assert _reason(codec, [b"\0" * OVERHEAD_BYTES, b"x"]) == "unauthenticated"


def _signed(codec, body: bytes, *buffers: bytes, head: bytes | None = None) -> list[bytes]:
    """Frames a peer holding the secret could send: any header and body, correctly tagged."""
    head = HEADER.pack() if head is None else head
    tag = codec._tag(head, [memoryview(f) for f in (body, *buffers)])
    return [head + tag + body, *buffers]


def test_authenticated_but_malformed_body_is_malformed(codec):
    """A peer holding the secret that sends nonsense still cannot crash the receiver."""
    assert _reason(codec, [bytes(encode(codec, None)[0])[:OVERHEAD_BYTES] + b"\xc1", b"abc"]
                   ) == "unauthenticated"
    assert _reason(codec, _signed(codec, b"\xc1", b"abc")) == "malformed"
    bad_ext = msgpack.packb(msgpack.ExtType(1, msgpack.packb([5, "<f4", [1]])))
    assert _reason(codec, _signed(codec, bad_ext, b"abcd")) == "malformed"
    short = msgpack.packb(msgpack.ExtType(1, msgpack.packb([0, "<f4", [4]])))
    assert _reason(codec, _signed(codec, short, b"abcd")) == "malformed"
    big = b"x" * 5000  # the Poly1305 path too
    assert _reason(codec, _signed(codec, b"\xc1", big)) == "malformed"


def test_large_messages_use_the_fast_mac_and_verify(codec):
    a = np.arange(100_000, dtype=np.float32)
    frames = [bytes(f) for f in encode(codec, {"a": a})]
    assert np.array_equal(decode(codec, frames)["a"], a)
    b = bytearray(frames[1])
    b[-1] ^= 0x80
    assert _reason(codec, [frames[0], bytes(b)]) == "unauthenticated"


def test_oversized(codec):
    with pytest.raises(WireError, match="max_message_bytes"):  # the sender refuses it
        encode(codec, {"a": np.zeros(300_000)})
    big = Codec(codec._secret, max_message_bytes=1 << 30)      # a sender with a larger limit
    frames = [bytes(f) for f in encode(big, {"a": np.zeros(300_000)})]
    assert _reason(codec, frames) == "oversized"


def test_header_is_authenticated_and_admitted_before_parsing(codec):
    frames = [bytes(f) for f in encode(codec, {"x": 1}, Header(Channel.REQUEST, b"a" * 16, 7,
                                                                 b"b" * 16))]
    for i in range(HEADER_BYTES):  # every header byte is covered by the tag
        bad = bytearray(frames[0])
        bad[i] ^= 1
        assert _reason(codec, [bytes(bad)]) == "unauthenticated"
    seen = []

    def refuse(h: Header) -> None:
        seen.append(h)
        raise DroppedMessage("replayed", "no")

    with pytest.raises(DroppedMessage, match="replayed"):
        codec.decode(_signed(codec, b"\xc1", head=frames[0][:HEADER_BYTES]), refuse)
    assert seen == [Header(Channel.REQUEST, b"a" * 16, 7, b"b" * 16)]  # before the bad body
    assert _reason(codec, _signed(codec, b"\xc0", head=b"\x09" + HEADER.pack()[1:])
                   ) == "malformed"  # unknown version


def _tensor_frames(codec, code: int, dtype, shape, data: bytes) -> list[bytes]:
    body = msgpack.packb({"t": msgpack.ExtType(code, msgpack.packb([0, dtype, shape]))})
    return _signed(codec, body, data)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("code", [1, 2])
def test_declared_shape_must_match_the_frame(codec, code):
    """A peer holding the secret cannot make a receiver allocate what it did not send."""
    dtype = "<f4" if code == 1 else "float32"
    before = _peak_rss_mib()
    assert _reason(codec, _tensor_frames(codec, code, dtype, [1 << 28], b"")) == "malformed"
    assert _reason(codec, _tensor_frames(codec, code, dtype, [1 << 14, 1 << 14, 0, -1], b"")
                   ) == "malformed"
    assert _peak_rss_mib() - before < 64  # 1 GiB was declared, nothing was allocated
    for shape in ([3], [2, 3], [-1, -4], [1.5], ["4"], [1] * 40, 4):
        assert _reason(codec, _tensor_frames(codec, code, dtype, shape, b"\0" * 16)
                       ) == "malformed", shape
    ok = decode(codec, _tensor_frames(codec, code, dtype, [2, 2], b"\0" * 16))["t"]
    assert tuple(ok.shape) == (2, 2)
    empty = decode(codec, _tensor_frames(codec, code, dtype, [0, 1 << 30], b""))["t"]
    assert tuple(empty.shape) == (0, 1 << 30)


@pytest.mark.parametrize("code,dtype", [
    (2, "Tensor"), (2, "load"), (2, "__class__"), (2, "nn"), (2, "float"), (2, 5),
    (1, "O"), (1, "|O8"), (1, "<U4"), (1, "V16"), (1, ">f4"), (1, "M8[s]"), (1, None),
    (3, "float32")])
def test_dtypes_come_from_an_allow_list(codec, code, dtype):
    assert _reason(codec, _tensor_frames(codec, code, dtype, [4], b"\0" * 16)) == "malformed"


def test_torch_only_dtypes_round_trip_as_raw_bytes(codec):
    t = torch.arange(6, dtype=torch.float32).to(torch.float8_e4m3fn)
    out = roundtrip(codec, t)
    assert out.dtype == torch.float8_e4m3fn and torch.equal(out.float(), t.float())


def test_frames_are_read_only_views_of_the_received_bytes(codec):
    frames = [bytes(f) for f in encode(codec, np.arange(100_000, dtype=np.int32))]
    out = decode(codec, frames)
    assert not out.flags.writeable
