"""The generation engine's settings per device: GPU defaults where CUDA is, CPU ones elsewhere."""
from __future__ import annotations

import pytest

from system.errors import ConfigError
from system.launch import build_config
from workers.engines.vllm_config import VllmConfig, VllmEngineArgs


def test_defaults_per_device():
    gpu, cpu = VllmConfig().engine_args(on_gpu=True), VllmConfig().engine_args(on_gpu=False)
    assert gpu == VllmEngineArgs(dtype="bfloat16", gpu_memory_utilization=0.85,
                                 enforce_eager=False, inline=False)
    assert cpu == VllmEngineArgs(dtype="float32", gpu_memory_utilization=0.2,
                                 enforce_eager=True, inline=True)


def test_explicit_settings_win_on_either_device():
    cfg = VllmConfig(dtype="float32", gpu_memory_utilization=0.5, enforce_eager=True,
                     engine_process="inline")
    for on_gpu in (True, False):
        assert cfg.engine_args(on_gpu) == VllmEngineArgs("float32", 0.5, True, True)
    assert VllmConfig(tensor_parallel_size=2).engine_args(on_gpu=False).inline is False


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="gpu_memory_utilization=1.5"):
        VllmConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="enforce_eager"):
        VllmConfig(enforce_eager="sometimes")  # type: ignore[arg-type]
    for bad in (0, -1.0, "1"):
        with pytest.raises(ConfigError, match="kv_cache_gib"):
            VllmConfig(kv_cache_gib=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="resolved dtype"):
        VllmEngineArgs("float16", 0.5, True, True)


def test_overrides_reach_the_engine_settings():
    cfg = build_config("arith-tiny", "t", ["rl.vllm.enforce_eager=false",
                                           "rl.vllm.gpu_memory_utilization=0.7"])
    assert cfg.rl.vllm.engine_args(on_gpu=False) == VllmEngineArgs("float32", 0.7, False, True,
                                                                   kv_cache_bytes=2**28)
    back = build_config("arith-tiny", "t", ["rl.vllm.enforce_eager=null"]).rl.vllm
    assert back.enforce_eager is None and back.engine_args(on_gpu=True).enforce_eager is False


def test_a_kv_cache_size_in_gib_is_passed_as_bytes():
    assert VllmConfig().engine_args(on_gpu=False).kv_cache_bytes is None  # sized by utilization
    assert VllmConfig(kv_cache_gib=0.5).engine_args(on_gpu=True).kv_cache_bytes == 2**29
    cfg = build_config("arith-tiny", "t", ["rl.vllm.kv_cache_gib=null"])
    assert cfg.rl.vllm.engine_args(on_gpu=False).kv_cache_bytes is None
