"""The trial's file system fills up mid-run (a real 6 MiB tmpfs as the fileroot: the second
checkpoint does not fit). The failure is named after the full disk, in one line, and not
recovered (a restart would fail the same way); nothing is left running. Once there is space
(the tmpfs grown), launching again continues from the latest checkpoint and completes, the
half-written checkpoint gone.

The run has no held-out prompts (``rl.task.eval_size=0``): it trains without evaluating, its
records stay valid JSON (no ``NaN``), and ``mode=eval`` is refused in one line."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import NO_SPARES, run_launch, tmpfs, trial_processes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]

ARGS = ("exp=arith-tiny", "trial=disk", "rl.total_steps=8", "rl.save_interval=2",
        "rl.batch_size=4", "rl.group_size=4", "rl.task.train_size=14",
        "rl.task.eval_size=0", "controller.progress=false", NO_SPARES)


def strict_json(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def small_fs(tmp_path):
    with tmpfs(str(tmp_path / "fs"), "6m") as root:
        yield root


def test_a_full_disk_is_named_not_recovered_and_the_trial_continues_once_there_is_space(
        small_fs):
    fileroot = small_fs
    trial_dir = os.path.join(fileroot, "arith-tiny", "disk")
    r = run_launch(*ARGS, f"cluster.fileroot={fileroot}", timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors and errors[0].startswith(
        f"error: the file system of the trial directory {trial_dir} is full ("), r.stderr[-3000:]
    assert "recovering" not in r.stderr  # a restart would fail the same way
    # the last line names summary.json only where it was written (often there is no room)
    last = r.stderr.strip().splitlines()[-1]
    summary = os.path.join(trial_dir, "summary.json")
    assert last == (f"failed: {summary}" if os.path.isfile(summary) else
                    "failed (no summary.json: see above)"), r.stderr[-3000:]
    assert trial_processes(trial_dir) == []
    checkpoints = os.path.join(trial_dir, "checkpoints")
    committed = [d for d in os.listdir(checkpoints) if not d.endswith(".tmp") and d != "latest"]
    assert committed, os.listdir(checkpoints)

    subprocess.run(["mount", "-o", "remount,size=64m", fileroot], check=True)
    r = run_launch(*ARGS, f"cluster.fileroot={fileroot}", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(trial_dir, "summary.json")) as f:
        s = strict_json(f.read())
    assert s["status"] == "completed" and s["steps"] == 8 and s["resumed_from_step"] >= 1
    assert s["eval_accuracy_before"] is None and s["eval_accuracy_after"] is None
    assert not [d for d in os.listdir(checkpoints) if d.endswith(".tmp")]
    with open(os.path.join(trial_dir, "metrics.jsonl")) as f:
        rows = [strict_json(line) for line in f]
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert not any("eval_accuracy" in row for row in rows)

    r = run_launch("exp=arith-tiny", "trial=disk", "mode=eval", f"cluster.fileroot={fileroot}",
                   timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "no held-out prompts to evaluate on (rl.task.eval_size=0)" in line
