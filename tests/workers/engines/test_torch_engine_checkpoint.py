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
