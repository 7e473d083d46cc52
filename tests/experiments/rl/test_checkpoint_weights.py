"""A checkpoint's policy weights read without a model worker equal the engine's own full state
dict, exactly: the torch engine (plain, tied embeddings, two FSDP2 ranks) and the megatron
engine (tp=2), each after a training step and saved as the model worker saves it."""
from __future__ import annotations

import datetime
import os
import queue

import pytest
import torch

from experiments.rl.checkpoint_weights import (CheckpointFormatError, actor_dir,
                                               checkpoint_state_dict)
from workers.engines.torch_engine import TorchEngine, TorchEngineConfig
from tests.helpers import end_rank, rank_context


def _seqs(n: int = 6, vocab: int = 100) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def sft_loss(lps, idx):
    return -sum(lp.sum() for lp in lps)


def _assert_same(ckpt: dict, engine: dict) -> None:
    assert ckpt.keys() == engine.keys()
    for k, v in engine.items():
        assert ckpt[k].dtype == v.dtype and torch.equal(ckpt[k], v), k


def _tiny(directory: str, tied: bool) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=100, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, max_position_embeddings=256, tie_word_embeddings=tied)
    Qwen2ForCausalLM(cfg).float().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("tied", [False, True])
def test_torch_engine_checkpoint_reads_back_as_its_full_state(tmp_path, tied):
    model = _tiny(str(tmp_path / "model"), tied)
    eng = TorchEngine(TorchEngineConfig(model_path=model, lr=1e-2))
    seqs = _seqs()
    eng.train_step(seqs, sft_loss, sum(len(s) - 1 for s in seqs))
    step_dir = tmp_path / "step_1"
    os.makedirs(step_dir / "actor")
    eng.save(str(step_dir / "actor"), 0)  # what the model worker writes under <step>/actor
    from safetensors.torch import load_file

    base = load_file(os.path.join(model, "model.safetensors"))
    full = eng.full_state_dict()
    _assert_same(checkpoint_state_dict(str(step_dir)), full)
    assert not torch.equal(base["model.norm.weight"], full["model.norm.weight"])  # trained


def test_a_checkpoint_without_hf_weights_is_refused_naming_the_backend(tmp_path):
    os.makedirs(tmp_path / "step_3" / "actor")
    (tmp_path / "step_3" / "actor" / "optimizer.rank0.pt").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match=r"rl.actor.backend=megatron"):
        actor_dir(str(tmp_path / "step_3"), "megatron")


def _fsdp_rank(rank: int, port: int, model: str, step_dir: str, out) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    eng = TorchEngine(TorchEngineConfig(model_path=model, lr=1e-2), world_size=2)  # FSDP2
    assert eng.sharded
    seqs = _seqs()
    eng.train_step(seqs[rank::2], sft_loss, sum(len(s) - 1 for s in seqs))
    os.makedirs(os.path.join(step_dir, "actor"), exist_ok=True)  # (the model worker does)
    eng.save(os.path.join(step_dir, "actor"), rank)
    dist.barrier()
    full = eng.full_state_dict()  # collective
    if rank == 0:
        _assert_same(checkpoint_state_dict(step_dir), full)
        out.put("ok")
    end_rank()


def _megatron_rank(rank: int, port: int, model: str, step_dir: str, out) -> None:
    import torch.distributed as dist

    from workers.engines.configs import MegatronConfig
    from workers.engines.megatron_engine import MegatronEngine

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    eng = MegatronEngine(TorchEngineConfig(model_path=model, lr=1e-2, backend="megatron",
                                           max_tokens_per_microbatch=40,
                                           megatron=MegatronConfig(tp=2, pp=1)), world_size=2)
    seqs = _seqs()
    eng.train_step(seqs, sft_loss, sum(len(s) - 1 for s in seqs))
    os.makedirs(os.path.join(step_dir, "actor"), exist_ok=True)  # (the model worker does)
    eng.save(os.path.join(step_dir, "actor"), rank)
    dist.barrier()
    full = eng.full_state_dict(eng.master_dtype)  # collective
    if rank == 0:
        _assert_same(checkpoint_state_dict(step_dir, "megatron"), full)
        out.put("ok")
    end_rank()


def _two_ranks(target, model: str, step_dir: str) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store.port, model, step_dir, q))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                assert q.get(timeout=2) == "ok"
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank failed (exit codes {dead})"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]


def test_fsdp_two_rank_checkpoint_reads_back_as_the_gathered_state(tmp_path):
    model = _tiny(str(tmp_path / "model"), tied=False)
    _two_ranks(_fsdp_rank, model, str(tmp_path / "step_1"))


def test_megatron_tp2_checkpoint_reads_back_as_its_full_state(tmp_path):
    pytest.importorskip("megatron.core")
    model = _tiny(str(tmp_path / "model"), tied=False)
    _two_ranks(_megatron_rank, model, str(tmp_path / "step_1"))
