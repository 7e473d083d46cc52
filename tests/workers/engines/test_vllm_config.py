"""The generation engine's settings per device: GPU defaults where CUDA is, CPU ones elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from system.errors import ConfigError
from system.launch import build_config
from workers.engines.vllm_config import (Sampling, VllmConfig, VllmEngineArgs, check_vocab,
                                         prompt_ids)


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
    for bad in (-1, "5", float("inf")):
        with pytest.raises(ConfigError, match="step_timeout"):
            VllmConfig(step_timeout=bad)  # type: ignore[arg-type]
    assert build_config("arith-tiny", "t", ["rl.vllm.step_timeout=0"]).rl.vllm.step_timeout == 0
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


def test_each_setting_is_named_alone():
    # (a section names its own fields; the override machinery adds rl.vllm.)
    with pytest.raises(ConfigError, match=r"^max_model_len must be >= 8 .*got 4"):
        VllmConfig(max_model_len=4)
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size must be >= 1, got 0"):
        VllmConfig(tensor_parallel_size=0)
    for bad in (-1, 1 << 32):  # vLLM seeds numpy with it: ValueError in every engine start
        with pytest.raises(ConfigError, match=r"^seed must be in \[0, 2\*\*32\)"):
            VllmConfig(seed=bad)
    assert VllmConfig(seed=(1 << 32) - 1).seed == (1 << 32) - 1


def test_the_numa_nodes_vllm_binds_to(tmp_path):
    from workers.engines.vllm_config import memory_nodes

    status = tmp_path / "status"
    status.write_text("Name:\tpython\nMems_allowed:\t00000003\nMems_allowed_list:\t0-1,3\n")
    assert memory_nodes({}, str(status)) == [0, 1, 3]
    assert memory_nodes({"CPU_VISIBLE_MEMORY_NODES": "3,1,7"}, str(status)) == [3, 1]
    assert memory_nodes({"CPU_VISIBLE_MEMORY_NODES": "3", "VLLM_CPU_SIM_MULTI_NUMA": "1"},
                        str(status)) == [0, 1, 3]
    assert memory_nodes({}, str(tmp_path / "absent")) == [0]
    assert memory_nodes({}) != []  # this machine's own /proc/self/status


def test_tensor_parallelism_on_cpu_takes_a_numa_node_per_rank():
    from workers.engines.vllm_config import cpu_tensor_parallel_problem as problem

    assert problem(1, [0], {}) is None and problem(2, [0, 1], {}) is None
    text = problem(2, [0], {}, key="rl.vllm.tensor_parallel_size")
    assert text is not None and text.startswith("rl.vllm.tensor_parallel_size=2 cannot run")
    assert text.endswith("may use 1 NUMA node (0); valid: rl.vllm.tensor_parallel_size <= 1 "
                         "on this machine (on GPUs it counts GPUs)")
    assert "4 cannot run" in problem(4, [0, 1], {}) and "2 NUMA nodes (0, 1)" in problem(
        4, [0, 1], {})
    # bound by hand, or simulated nodes: vLLM does not ask for NUMA nodes then
    for env in ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, {"VLLM_CPU_SIM_MULTI_NUMA": "1"}):
        assert problem(2, [0], env) is None
    assert problem(2, [0], {"VLLM_CPU_SIM_MULTI_NUMA": "0"}) is not None


def test_a_prompt_and_completion_past_the_context_names_the_keys():
    """What a generation server answers (an RL rollout, and an HTTP request, whose field is
    max_tokens too) when a prompt and its completion do not fit."""
    from workers.engines.vllm_config import check_context

    check_context(5, 123, 128)
    with pytest.raises(ConfigError, match=r"^prompt \(5 tokens\) \+ max_tokens \(124\) exceeds "
                                          r"rl\.vllm\.max_model_len=128; valid: max_tokens <= "
                                          r"123 for this prompt \(in a training rollout: "
                                          r"rl\.agent\.max_new_tokens"):
        check_context(5, 124, 128)
    with pytest.raises(ConfigError, match=r"valid: a prompt under 128 tokens"):
        check_context(603, 4, 128)


def test_prompts_are_checked_token_ids_in_the_vocabulary():
    assert prompt_ids(np.array([1, 2, 3]), 10) == [1, 2, 3]
    assert prompt_ids((np.int64(4),), 10) == [4]
    for bad, match in [([], "empty prompt"), ("12", "must be a list"), ([1.5], "prompt token"),
                       ([1, 10], r"must be in \[0, 10\), got 1..10"), ([-1], "got -1..-1")]:
        with pytest.raises(ConfigError, match=match):
            prompt_ids(bad, 10)
    check_vocab("stop_token_ids", (), 10)
    with pytest.raises(ConfigError, match="stop_token_ids must be in"):
        check_vocab("stop_token_ids", (3, 10), 10)


def test_the_temperature_recorded_is_the_one_vllm_samples_at():
    """vLLM samples a temperature in (0, 0.01) at 0.01 and 0 greedily (its log-probs then the
    model's own): what the trainer takes its log-probs at."""
    from workers.engines.vllm_config import logprob_temperature

    assert Sampling(temperature=0.005).temperature == 0.01
    assert Sampling(temperature=0.0).logprob_temperature == 1.0
    assert Sampling(temperature=0.7).logprob_temperature == 0.7
    assert logprob_temperature(1e-6) == 0.01 and logprob_temperature(0) == 1.0
