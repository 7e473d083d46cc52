"""The RL experiment on a real Slurm (the single-node test cluster), preempted job by job: a
generation server's job and the model worker's job get Slurm's preemption warning (SIGUSR2) and
requeue themselves; the trial goes on by itself and ends at the same step."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import REPO, launch_argv, read_summary
from tests.scheduler.test_slurm_e2e import SLURM, job_of, squeue, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]

SMALL = ["rl.batch_size=4", "rl.group_size=4", "rl.task.train_size=14", "rl.task.eval_size=8",
         "rl.eval_interval=0", "controller.progress=false", "rl.save_interval=0",
         "rl.save_interval_s=0", "rl.save_overhead=0", "recover.backoff=0.5"]


def _steps(root: str) -> list[int]:
    import json

    path = os.path.join(root, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def test_preempted_generation_and_model_jobs_continue_by_themselves(slurm_cluster, tmp_path):
    """USR2 to the generation job: the server stops, its job requeues, comes back, joins a fresh
    weight-sync group with the current weights (no restart of anything else). Then USR2 to the
    model job: the model worker asks for a checkpoint, stops once it is written, its job
    requeues, and the controller restarts the master and model worker from that checkpoint
    (no step lost). The trial completes its steps and leaves no job behind."""
    root = str(tmp_path / "runs")
    trial_root = os.path.join(root, "arith-tiny", "preempt")
    env = {**os.environ, **slurm_cluster.env}
    proc = subprocess.Popen(launch_argv("exp=arith-tiny", "trial=preempt",
                                        f"cluster.fileroot={root}", "rl.total_steps=40", *SLURM,
                                        *SMALL),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        wait_for(lambda: max(_steps(trial_root), default=0) >= 2, 300, "step 2")
        gen_job = job_of(slurm_cluster.env, "arith-tiny", "preempt", "generation")
        subprocess.run(["scancel", "--signal=USR2", gen_job], check=True, env=env)
        master_log = os.path.join(trial_root, "logs", "master-0.log")
        # 600 s: a server that dies mid-transfer can leave the trainer's send waiting out the
        # weight-sync group timeout (rl.weight_sync.timeout, 300 s) before it rejoins
        wait_for(lambda: "generation server 0 rejoined" in open(master_log).read(), 600,
                 "the generation server to rejoin")
        model_job = job_of(slurm_cluster.env, "arith-tiny", "preempt", "model")
        subprocess.run(["scancel", "--signal=USR2", model_job], check=True, env=env)
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    s = read_summary(root, "arith-tiny", "preempt")
    assert s["status"] == "completed" and s["steps"] == 40
    assert s["restarts"].get(gen_job) == 1, s["restarts"]
    (rec,) = s["recoveries"]
    assert rec["worker"] == "model/0" and rec["stateful"] and "requeued" in rec["cause"], rec
    assert rec["steps_lost"] == 0 and rec["resumed_from"] == rec["failed_step"], rec
    with open(os.path.join(trial_root, "logs", "model-0.log")) as f:
        assert "checkpoint committed after SIGUSR2" in f.read()
    assert "rejoined: generation/0" in err
    assert squeue(slurm_cluster.env, "arith-tiny", "preempt") == []
