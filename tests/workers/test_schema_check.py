"""Schema checks of streamed messages: a wrong-shaped message is named, never read."""
from __future__ import annotations

import numpy as np
import pytest

from system.streams import StreamPuller, StreamPusher
from system.wire import Codec, new_secret
from workers.schema_check import group_message_problem


def _traj(prompt: int = 3, completion: int = 4) -> dict:
    return {"tokens": np.arange(prompt + completion, dtype=np.int32), "prompt_len": prompt,
            "mask": np.ones(completion, np.int8), "logprobs": np.zeros(completion, np.float32),
            "versions": np.zeros(completion, np.int32), "finish": "stop", "reward": 1.0}


def _group(**change) -> dict:
    return {"seq": 1, "prompt_id": 2, "worker": 0, "server": 0, "trajs": [_traj(), _traj(2, 0)],
            "failed": False, "error": "", "unservable": False, "agent_error": False,
            **change}


def test_a_good_group_passes():
    assert group_message_problem(_group()) is None
    assert group_message_problem(_group(trajs=[], failed=True, error="boom")) is None


@pytest.mark.parametrize("bad", [
    None, [1], {"kind": "ping", "index": 0},                 # not a group at all
    _group(seq="1"), _group(seq=True), _group(failed=1), _group(trajs={}),
    _group(trajs=[{"tokens": [1, 2]}]),
    _group(trajs=[{**_traj(), "prompt_len": 0}]),
    _group(trajs=[{**_traj(), "prompt_len": 99}]),
    _group(trajs=[{**_traj(), "tokens": np.zeros((2, 4), np.int32)}]),
    _group(trajs=[{**_traj(), "tokens": np.zeros(7, np.float32)}]),
    _group(trajs=[{**_traj(), "mask": np.ones(3, np.int8)}]),
    _group(trajs=[{**_traj(), "logprobs": np.zeros(4, np.int64)}]),
    _group(trajs=[{k: v for k, v in _traj().items() if k != "versions"}]),
    _group(trajs=[{**_traj(), "reward": "high"}]),
    _group(trajs=[{k: v for k, v in _traj().items() if k != "reward"}]),
    _group(trajs=[{**_traj(), "reward": float("nan")}]),
    _group(trajs=[{**_traj(), "reward": True}]),
])
def test_a_bad_group_is_named(bad):
    assert isinstance(group_message_problem(bad), str)


def test_a_group_of_the_wrong_size_is_named_unless_it_failed():
    assert group_message_problem(_group(), group_size=2) is None
    assert "3 trajectories, not 2" in group_message_problem(
        _group(trajs=[_traj(), _traj(), _traj()]), group_size=2)
    assert group_message_problem(_group(trajs=[], failed=True, error="x"), group_size=2) is None


def test_the_master_stream_drops_bad_groups():
    """The master's trajectory stream (experiments/rl/loop.py) reads only valid groups."""
    codec = Codec(new_secret())
    puller = StreamPuller(codec, "127.0.0.1", validate=group_message_problem)
    pusher = StreamPusher(codec, puller.address)
    for msg in ({"kind": "master", "index": 0, "state": "running"}, _group(seq="x"), _group()):
        pusher.send(msg)
    got = puller.recv(5)
    assert got["seq"] == 1 and len(got["trajs"]) == 2
    assert puller.drops.malformed == 2
    pusher.close()
    puller.close()
