"""A worker's device: its own GPU, never wrapped onto another worker's."""
from __future__ import annotations

import pytest

from system.errors import ConfigError
from workers.devices import select_device


def test_device_selection():
    assert select_device(0, 0) == "cpu" and select_device(3, 0) == "cpu"
    assert select_device(5, 1) == "cuda:0"  # placement left it exactly its own
    assert select_device(2, 4) == "cuda:2"  # it sees its node's GPUs: the local rank's
    with pytest.raises(ConfigError, match="local rank 2 sees 2 GPUs"):
        select_device(2, 2)
