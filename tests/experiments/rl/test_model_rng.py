"""Every model worker's RNG states come back on resume (``rng.model{rank}.pt``)."""
from __future__ import annotations

import os
import random

import torch

from experiments.rl.roles.model import restore_rng
from system.digests import file_digest
from workers.model_checkpoint import save_checkpoint


def _save(directory: str) -> None:
    """A lone model worker's checkpoint part without engines: it only writes the RNG file."""
    name = "rng.model0.pt"  # the one rank digests every file
    assert save_checkpoint({}, directory, 0, 1, "cpu") == {
        "rank": 0, "digests": {name: file_digest(os.path.join(directory, name))}}


def test_model_worker_rng_states_are_restored(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    torch.rand(3), random.random()
    _save(str(tmp_path))
    want_torch, want_py = torch.rand(4), [random.random() for _ in range(4)]
    torch.manual_seed(7)
    random.seed(7)
    restore_rng(str(tmp_path), 0, "cpu")
    assert torch.equal(torch.rand(4), want_torch)
    assert [random.random() for _ in range(4)] == want_py


def test_the_rng_file_loads_without_unpickling_objects(tmp_path):
    _save(str(tmp_path))
    blob = torch.load(os.path.join(tmp_path, "rng.model0.pt"), weights_only=True)
    assert isinstance(blob["python"], list) and isinstance(blob["python"][1], list)


def test_a_missing_rng_file_is_a_warning(tmp_path, caplog):
    restore_rng(str(tmp_path), 3, "cpu")
    assert "rng.model3.pt" in caplog.text
