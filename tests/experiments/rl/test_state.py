"""The master's checkpointed state: a pickle-free round trip of arrays, groups and RNG states."""
from __future__ import annotations

import dataclasses
import os
import random
import re

import msgpack
import numpy as np
import pytest

from experiments.rl.state import (MASTER_STATE, Admitted, LoopState, decode_state, encode_state,
                                  load_state, save_state)
from system.paths import PROJECT_ROOT


def _group(seq: int) -> dict:
    rng = np.random.default_rng(seq)
    trajs = [{"tokens": rng.integers(0, 100, 9).astype(np.int64), "prompt_len": 4,
              "mask": np.array([1, 1, 0, 1, 1], dtype=np.int8),
              "logprobs": rng.normal(size=5).astype(np.float32),
              "versions": np.full(5, seq, dtype=np.int32), "finish": "stop",
              "reward": np.float64(0.5)} for _ in range(2)]
    return {"seq": seq, "prompt_id": 10 + seq, "worker": 0, "server": 1, "trajs": trajs,
            "failed": False, "error": "", "unservable": False, "agent_error": False}


def _state() -> LoopState:
    return LoopState(step=7, consumed=28, cursor={"epoch": 1, "pos": 3, "redo": [[5, 0], [2, 1]]},
                     buffer=[(Admitted(_group(1), 0), 6), (Admitted(_group(2), 1), 7)],
                     history=[[[1, 0], [2, 0]], [[3, 0], [4, 1]]], max_staleness=1,
                     eval_before=0.25, loop_seconds=12.5, staleness_bound=1, dropped_stale=3,
                     leases_expired=2, leases_released=1)


def _assert_groups_equal(got: dict, want: dict) -> None:
    assert {k: v for k, v in got.items() if k != "trajs"} == \
        {k: v for k, v in want.items() if k != "trajs"}
    for a, b in zip(got["trajs"], want["trajs"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(b[k], np.ndarray):
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                np.testing.assert_array_equal(a[k], b[k])
                a[k][0] = a[k][0]  # restored arrays are writable
            else:
                assert a[k] == b[k]


def test_loop_state_round_trips_with_arrays_and_rng_states(tmp_path):
    random.seed(3)
    np.random.seed(4)
    random.random(), np.random.normal()  # mid-stream, with numpy's cached gaussian set
    state = _state()
    save_state(str(tmp_path), state)
    want_py, want_np = [random.random() for _ in range(3)], np.random.normal(size=3)
    random.seed(99)
    np.random.seed(99)
    got = load_state(str(tmp_path))
    assert [random.random() for _ in range(3)] == want_py
    np.testing.assert_array_equal(np.random.normal(size=3), want_np)
    for field in ("step", "consumed", "cursor", "history", "max_staleness", "eval_before",
                  "loop_seconds", "staleness_bound", "dropped_stale", "leases_expired",
                  "leases_released"):
        assert getattr(got, field) == getattr(state, field), field
    assert [(a.epoch, v) for a, v in got.buffer] == [(0, 6), (1, 7)]
    for (a, _), (b, _) in zip(got.buffer, state.buffer, strict=True):
        _assert_groups_equal(a.group, b.group)


def test_the_master_state_is_not_a_pickle(tmp_path):
    save_state(str(tmp_path), _state())
    raw = open(os.path.join(tmp_path, MASTER_STATE), "rb").read()
    assert not raw.startswith(b"\x80")  # pickle protocol 2+ opcode
    assert decode_state(raw).step == 7


def test_objects_that_are_not_plain_values_are_refused():
    state = LoopState(cursor={"x": object()})
    with pytest.raises(TypeError):
        encode_state(state)


def test_no_pickle_in_the_packages():
    """Checkpoints and messages never unpickle: no module imports pickle, none loads torch
    files with ``weights_only=False``."""
    bad = re.compile(r"^\s*(import (c?pickle|dill|cloudpickle)|from (c?pickle|dill|cloudpickle) "
                     r"import)|weights_only\s*=\s*False", re.M)
    found = []
    for pkg in ("system", "workers", "experiments", "scheduler"):
        for base, _, names in os.walk(os.path.join(PROJECT_ROOT, pkg)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(base, name)
                    if bad.search(open(path).read()):
                        found.append(os.path.relpath(path, PROJECT_ROOT))
    assert found == []


def test_a_state_saved_before_the_trial_wide_counters_loads_with_them_at_zero(tmp_path):
    fields = {k: v for k, v in encode_and_strip(_state()).items()
              if k not in ("staleness_bound", "dropped_stale", "leases_expired",
                           "leases_released", "filtered")}
    got = decode_state(msgpack.packb(fields))
    assert (got.staleness_bound, got.dropped_stale, got.leases_expired,
            got.leases_released, got.filtered) == (None, 0, 0, 0, 0)


def encode_and_strip(state: LoopState) -> dict:
    return msgpack.unpackb(encode_state(dataclasses.replace(state, buffer=[], rng=None)))
