"""The weight-sync backend from the ranks' physical devices (pure): NCCL only when every rank is
on a GPU of its own; gloo, with the reason, when a rank is on the CPU or two share a GPU."""
from __future__ import annotations

import pytest

from system.reshard.backend import (CPU, BackendChoice, RankDevice, and_list, choose_backend,
                                    device_identity, shared_devices)

GPU_A, GPU_B, GPU_C = ("GPU-6f1c2a4e-0000-0000-0000-00000000000a",
                       "GPU-6f1c2a4e-0000-0000-0000-00000000000b",
                       "GPU-6f1c2a4e-0000-0000-0000-00000000000c")


def ranks(*devices: str) -> list[RankDevice]:
    names = ["model-0", "model-1", "generation-0 tp0", "generation-0 tp1"]
    return [RankDevice(n, d) for n, d in zip(names, devices)]


def test_every_rank_on_a_gpu_of_its_own_is_nccl():
    choice = choose_backend(ranks(GPU_A, GPU_B, GPU_C))
    assert choice == BackendChoice("nccl") and not choice.fallback
    assert choice.line() == "weight sync: nccl"


def test_every_rank_on_the_cpu_is_gloo_and_no_fallback():
    choice = choose_backend(ranks(CPU, CPU, CPU))
    assert choice.backend == "gloo" and not choice.fallback


def test_a_rank_on_the_cpu_beside_gpus_is_gloo_naming_it():
    choice = choose_backend(ranks(GPU_A, GPU_B, CPU))
    assert choice.backend == "gloo" and choice.fallback
    assert choice.line() == ("weight sync: gloo (generation-0 tp0 on the CPU, model-0 and "
                             "model-1 on a GPU); NCCL needs every rank on a GPU")


def test_ranks_sharing_a_gpu_are_gloo_naming_them_and_the_gpu():
    choice = choose_backend(ranks(GPU_A, GPU_B, GPU_A))  # the one-GPU machine's trainer + vLLM
    assert choice.backend == "gloo" and choice.fallback
    assert choice.line() == (f"weight sync: gloo (model-0 and generation-0 tp0 share GPU "
                             f"{GPU_A}); NCCL refuses two ranks on one GPU")
    assert "\n" not in choice.line()


def test_every_shared_gpu_is_named():
    choice = choose_backend(ranks(GPU_A, GPU_B, GPU_A, GPU_B))
    assert f"model-0 and generation-0 tp0 share GPU {GPU_A}" in choice.reason
    assert f"model-1 and generation-0 tp1 share GPU {GPU_B}" in choice.reason
    assert shared_devices(ranks(GPU_A, GPU_A, GPU_A)) == {
        GPU_A: ["model-0", "model-1", "generation-0 tp0"]}
    assert shared_devices(ranks(CPU, CPU, GPU_A)) == {}  # the CPU is no device to share


def test_one_rank_alone_and_the_edges():
    assert choose_backend([RankDevice("model-0", GPU_A)]).backend == "nccl"
    with pytest.raises(ValueError):
        choose_backend([])
    with pytest.raises(ValueError):
        RankDevice("model-0", "")
    with pytest.raises(ValueError):
        BackendChoice("mpi")
    assert and_list(["a"]) == "a" and and_list(["a", "b", "c"]) == "a, b and c"


def test_the_cpu_is_named_cpu():
    assert device_identity("cpu") == CPU
