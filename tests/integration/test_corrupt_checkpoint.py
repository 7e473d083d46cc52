"""A checkpoint whose content changed at the same size (a bad disk block): the model workers
find it as they restore it, mark it, and the restart that follows resumes from the one before."""
from __future__ import annotations

import json
import os

from system.digests import file_digest
from tests.helpers import metrics_rows, read_summary, run_launch, spare_kinds, trial_processes
from tests.integration.test_rl import SMALL


def test_a_corrupt_checkpoint_is_found_at_restore_and_the_one_before_it_resumes(fileroot):
    """Two model workers write the step 1 and 2 checkpoints (each digests its share of the
    files), the trial fails after step 2; one byte of step 2's model weights changes, leaving
    size and safetensors structure as they were. The relaunch picks step 2, the model worker
    whose share holds the file finds the change and marks the checkpoint corrupt; the
    recovery restarts the master and model workers, which resume from step 1 and complete."""
    args = ["exp=arith-tiny", "trial=corrupt", f"cluster.fileroot={fileroot}", "model.count=2",
            "rl.total_steps=3", "rl.save_interval=1", "rl.save_interval_s=0",
            "rl.save_overhead=0", *SMALL, spare_kinds("model", "master")]
    first = run_launch(*args, "recover=off", "rl.crash_at_step=2", timeout=400)
    assert first.returncode == 1, first.stderr[-3000:]
    root = os.path.join(fileroot, "arith-tiny", "corrupt")
    step2 = os.path.join(root, "checkpoints", "step_2")
    with open(os.path.join(step2, "meta.json")) as f:
        meta = json.load(f)
    assert meta["digests"] == {name: file_digest(os.path.join(step2, name))  # every file's
                               for name in meta["files"]}
    weights = os.path.join(step2, "actor", "model.safetensors")
    with open(weights, "r+b") as f:  # a byte of the last tensor's data
        f.seek(os.path.getsize(weights) - 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))

    second = run_launch(*args, "recover=auto", "recover.retries=1", "recover.backoff=0.5",
                        timeout=400)
    assert second.returncode == 0, second.stderr[-3000:]
    s = read_summary(fileroot, "arith-tiny", "corrupt")
    assert s["status"] == "completed" and s["steps"] == 3 and s["resumed_from_step"] == 1, s
    (rec,) = s["recoveries"]
    assert "step_2 is corrupt (actor/model.safetensors: content differs" in rec["cause"], rec
    assert [r["step"] for r in metrics_rows(root)] == [0, 1, 2, 3]  # step 2 trained again
    with open(os.path.join(root, "checkpoints", "latest")) as f:
        assert f.read().strip() == "3"
    assert trial_processes(root) == []
