"""A worker's device: its own GPU, never wrapped onto another worker's; model workers that
share one are refused before NCCL would be."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from system.errors import ConfigError
from system.reshard.backend import RankDevice
from workers.devices import check_own_devices, default_group_refusal, select_device


def test_device_selection():
    assert select_device(0, 0) == "cpu" and select_device(3, 0) == "cpu"
    assert select_device(5, 1) == "cuda:0"  # placement left it exactly its own
    assert select_device(2, 4) == "cuda:2"  # it sees its node's GPUs: the local rank's
    with pytest.raises(ConfigError, match="local rank 2 sees 2 GPUs"):
        select_device(2, 2)


GPU_A = "GPU-6f1c2a4e-0000-0000-0000-00000000000a"
GPU_B = "GPU-6f1c2a4e-0000-0000-0000-00000000000b"


def test_model_workers_sharing_a_gpu_are_refused_in_one_line_naming_the_keys():
    assert default_group_refusal([RankDevice("model-0", GPU_A),
                                  RankDevice("model-1", GPU_B)]) is None
    assert default_group_refusal([RankDevice("model-0", "cpu"),
                                  RankDevice("model-1", "cpu")]) is None
    why = default_group_refusal([RankDevice("model-0", GPU_A), RankDevice("model-1", GPU_A)])
    assert why is not None and "\n" not in why
    assert why.startswith(f"model-0 and model-1 share GPU {GPU_A}: ")
    assert "NCCL, which refuses two ranks on one GPU" in why
    assert "model.count" in why and "scheduler.local.share_gpus=true" in why


def _exchange(devices: list[str]) -> list[BaseException | None]:
    """Every rank runs check_own_devices over one real TCPStore (a thread per rank)."""
    host = dist.TCPStore("127.0.0.1", 0, len(devices), True, timedelta(seconds=10),
                         wait_for_workers=False)
    errors: list[BaseException | None] = [None] * len(devices)

    def rank(r: int) -> None:
        store = host if r == 0 else dist.TCPStore("127.0.0.1", host.port, len(devices), False,
                                                  timedelta(seconds=10))
        try:
            check_own_devices(store, r, len(devices), devices[r])
        except BaseException as e:
            errors[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_ranks_exchange_their_devices_before_the_group_forms():
    assert _exchange([GPU_A, GPU_B]) == [None, None]
    errors = _exchange([GPU_A, GPU_B, GPU_A])
    assert all(isinstance(e, ConfigError) for e in errors)  # every rank refuses, none hangs
    assert f"model-0 and model-2 share GPU {GPU_A}" in str(errors[1])
