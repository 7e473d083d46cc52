"""The torch engine's checkpoint loads without unpickling code (``weights_only=True``)."""
from __future__ import annotations

import os

import torch

from workers.engines.torch_engine import TorchEngine, TorchEngineConfig


def test_optimizer_shard_round_trips_with_weights_only(tiny_model_dir, tmp_path):
    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, lr=1e-3))
    seqs = [torch.arange(2, 12), torch.arange(5, 11)]
    eng.train_step(seqs, lambda lps, idx: -sum(lp.sum() for lp in lps), 14)
    eng.save(str(tmp_path), 0)
    blob = torch.load(os.path.join(tmp_path, "optimizer.rank0.pt"), weights_only=True)
    assert blob["steps"] == 1
    back = TorchEngine(TorchEngineConfig(model_path=str(tmp_path), lr=1e-3))
    back.load_optimizer(str(tmp_path), 0)
    assert back.steps == 1
    want, got = eng.optimizer.state_dict(), back.optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
            assert got["state"][i][k].device == v.device, (i, k)  # AdamW's step: on the CPU


def test_a_resumed_optimizer_takes_this_runs_learning_rate(tiny_model_dir, tmp_path, caplog):
    """rl.actor.lr changed when a trial continues: the moments come from the checkpoint, the
    learning rate (and betas, eps, weight decay) from the configuration, said once in the log."""
    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, lr=1e-3))
    eng.train_step([torch.arange(2, 12)], lambda lps, idx: -sum(lp.sum() for lp in lps), 10)
    eng.save(str(tmp_path), 0)
    back = TorchEngine(TorchEngineConfig(model_path=str(tmp_path), lr=5e-2))
    with caplog.at_level("INFO", logger="optimizer"):
        back.load_optimizer(str(tmp_path), 0)
    assert {g["lr"] for g in back.optimizer.param_groups} == {5e-2}
    assert "lr 0.001 -> 0.05" in caplog.text
    moments = [st["exp_avg"] for st in back.optimizer.state.values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # the state itself restored


def test_checkpoint_keeps_master_weights_and_publishes_in_the_engine_dtype(tiny_model_dir,
                                                                           tmp_path):
    """As under mixed precision on CUDA (float32 masters, bfloat16 published), emulated on the
    CPU: full_state_dict is in ``dtype``, the checkpoint keeps the float32 masters, and the
    restored engine's next step equals the original's."""
    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, lr=1e-3))
    eng.dtype = torch.bfloat16  # the publish dtype; the parameters stay float32
    seqs = [torch.arange(2, 12), torch.arange(5, 11)]
    loss = lambda lps, idx: -sum(lp.sum() for lp in lps)  # noqa: E731
    eng.train_step(seqs, loss, 14)
    published = eng.full_state_dict()
    assert all(t.dtype == torch.bfloat16 for t in published.values())
    eng.save(str(tmp_path), 0)
    back = TorchEngine(TorchEngineConfig(model_path=str(tmp_path), lr=1e-3))
    back.load_optimizer(str(tmp_path), 0)
    masters = dict(eng.model.named_parameters())
    for name, p in back.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, masters[name]), name
    eng.train_step(seqs, loss, 14)
    back.train_step(seqs, loss, 14)
    for name, p in back.model.named_parameters():
        assert torch.equal(p, masters[name]), name
