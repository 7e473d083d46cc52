"""The wire format: round trips with dtype and shape, and every kind of bad frame dropped."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from system.errors import WireError
from system.wire import AUTH_BYTES, Codec, DroppedMessage, new_secret


@pytest.fixture
def codec():
    return Codec(new_secret(), max_message_bytes=1 << 20)


def roundtrip(codec, payload):
    frames = codec.encode(payload)
    return codec.decode([bytes(f) for f in frames])


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
    frames = codec.encode({"a": a, "b": torch.ones(10)})
    assert len(frames) == 3 and frames[1].nbytes == 8000 and frames[2].nbytes == 40


def test_objects_that_need_pickle_are_refused(codec):
    with pytest.raises(WireError):
        codec.encode({"f": object()})
    with pytest.raises(WireError):
        codec.encode(np.array([object()], dtype=object))


def _reason(codec, frames):
    with pytest.raises(DroppedMessage) as e:
        codec.decode(frames)
    return e.value.reason


def test_tampering_is_detected(codec):
    frames = [bytearray(bytes(f)) for f in codec.encode({"a": np.arange(100)})]
    for i in range(len(frames)):
        bad = [bytes(f) for f in frames]
        b = bytearray(bad[i])
        b[len(b) // 2] ^= 1
        bad[i] = bytes(b)
        assert _reason(codec, bad) == "unauthenticated"


def test_reordered_dropped_and_extra_frames(codec):
    frames = [bytes(f) for f in codec.encode({"a": np.arange(4), "b": np.arange(5)})]
    assert _reason(codec, [frames[0], frames[2], frames[1]]) == "unauthenticated"
    assert _reason(codec, frames[:-1]) == "unauthenticated"
    assert _reason(codec, frames + [b"x"]) == "unauthenticated"


def test_wrong_secret(codec):
    other = Codec(new_secret())
    assert _reason(codec, [bytes(f) for f in other.encode({"x": 1})]) == "unauthenticated"


def test_truncated_and_garbage(codec):
    assert _reason(codec, []) == "malformed"
    assert _reason(codec, [b"only one"]) == "malformed"
    assert _reason(codec, [b"short", b"header"]) == "malformed"
    assert _reason(codec, [b"\0" * AUTH_BYTES + b"\xc1garbage"]) == "unauthenticated"
    assert _reason(codec, [b"\0" * AUTH_BYTES, b"x"]) == "unauthenticated"


def _signed(codec, body: bytes, *buffers: bytes) -> list[bytes]:
    nonce = b"\1" * 16
    tag = codec._tag(nonce, [memoryview(f) for f in (body, *buffers)])
    return [nonce + tag + body, *buffers]


def test_authenticated_but_malformed_body_is_malformed(codec):
    """A peer holding the secret that sends nonsense still cannot crash the receiver."""
    assert _reason(codec, [bytes(codec.encode(None)[0])[:AUTH_BYTES] + b"\xc1", b"abc"]
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
    frames = [bytes(f) for f in codec.encode({"a": a})]
    assert np.array_equal(codec.decode(frames)["a"], a)
    b = bytearray(frames[1])
    b[-1] ^= 0x80
    assert _reason(codec, [frames[0], bytes(b)]) == "unauthenticated"


def test_oversized(codec):
    frames = [bytes(f) for f in codec.encode({"a": np.zeros(300_000)})]
    assert _reason(codec, frames) == "oversized"
