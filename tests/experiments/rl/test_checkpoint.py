"""Checkpoint directories."""
from __future__ import annotations

import json
import os

from experiments.rl.checkpoint import CheckpointDir


def test_checkpoint_dir_is_atomic(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"), keep=2)
    assert ck.latest() is None
    for step in (2, 4, 6):
        d = ck.staging(step)
        open(os.path.join(d, "x"), "w").write(str(step))
        ck.commit(step, {"k": step})
    assert ck.latest() == 6
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step_4", "step_6"]
    ck.staging(8)  # a crash while writing step 8: still 6
    assert ck.latest() == 6
    assert json.load(open(os.path.join(ck.path(6), "meta.json")))["step"] == 6
