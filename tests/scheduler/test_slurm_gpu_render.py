"""GPU requests and per-task binding in rendered sbatch scripts (pure; golden file)."""
from __future__ import annotations

import pytest

from scheduler.registry import make_scheduler
from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from scheduler.slurm_render import render_worker_script
from system.errors import ConfigError
from system.launch import build_config
from system.launcher.groups import group_spec
from system.paths import TrialPaths
from tests.scheduler.test_slurm_render import check_golden


def render(kind: str, count: int, slurm: SlurmConfig, gpus_per_worker: int,
           first: int = 0) -> str:
    group = group_spec(kind, count, TrialPaths("/runs/gsm8k/t1"), "/opt/py/bin/python",
                       first=first)
    return render_worker_script(exp="gsm8k", trial="t1", group=group, slurm=slurm,
                                workdir="/work", umask=0o077, gpus_per_worker=gpus_per_worker)


def test_golden_generation_group_tp2():
    """Two vLLM servers of tensor-parallel size 2 on one node: the job asks for 4 GPUs, each
    task takes its own 2."""
    text = render("generation", 2, SlurmConfig(gpus=True), gpus_per_worker=2)
    check_golden("generation-gpu.sbatch", text)
    assert "#SBATCH --gpus-per-node=4\n" in text
    assert "\nexport RLSYS_GPUS_PER_TASK=2\n" in text


def test_multi_node_model_group_asks_per_node_and_binds_one_per_task():
    slurm = SlurmConfig(gpus=True, model=SlurmGroupConfig(nodes=2))
    text = render("model", 4, slurm, gpus_per_worker=1)
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks=4\n#SBATCH --ntasks-per-node=2\n" in text
    assert "#SBATCH --gpus-per-node=2\n" in text and "RLSYS_GPUS_PER_TASK=1\n" in text


def test_a_groups_own_gpus_per_node_is_kept_if_every_task_gets_its_own():
    slurm = SlurmConfig(model=SlurmGroupConfig(gpus_per_node=8))
    text = render("model", 4, slurm, gpus_per_worker=1)  # gpus=false: the group's own count
    assert "#SBATCH --gpus-per-node=8\n" in text and "RLSYS_GPUS_PER_TASK=1\n" in text
    with pytest.raises(ConfigError) as e:
        render("generation", 2, SlurmConfig(generation=SlurmGroupConfig(gpus_per_node=2)),
               gpus_per_worker=2)
    msg = str(e.value)
    assert "\n" not in msg and "scheduler.slurm.generation.gpus_per_node=2" in msg
    assert ">= 4" in msg and "scheduler.slurm.gpus=true" in msg


def test_cpu_jobs_request_and_bind_nothing():
    for text in (render("model", 2, SlurmConfig(), gpus_per_worker=1),          # gpus=false
                 render("rollout", 2, SlurmConfig(gpus=True), gpus_per_worker=0),
                 render("master", 1, SlurmConfig(gpus=True), gpus_per_worker=0)):
        assert "--gpus-per-node" not in text and "RLSYS_GPUS_PER_TASK" not in text


def test_a_lone_restart_asks_for_its_own_gpus_only():
    slurm = SlurmConfig(gpus=True, generation=SlurmGroupConfig(nodes=2))
    text = render("generation", 1, slurm, gpus_per_worker=2, first=3)
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --gpus-per-node=2\n" in text
    assert "RLSYS_GPUS_PER_TASK=2\n" in text and "RLSYS_WORKER_BASE=3\n" in text


def test_scheduler_takes_the_experiments_demands(tmp_path):
    """What the launcher builds: arith-tiny with tensor-parallel vLLM on a GPU Slurm cluster."""
    cfg = build_config("arith-tiny", "t1", [
        "scheduler=slurm", "scheduler.slurm.gpus=true", "model.count=4",
        "scheduler.slurm.model.nodes=2", "generation.count=2", "rl.vllm.tensor_parallel_size=4"])
    sched = make_scheduler(cfg.scheduler, cfg.exp, cfg.trial, str(tmp_path), 0o077,
                           cfg.gpu_demands())
    paths = TrialPaths(str(tmp_path))
    scripts = {k: sched.plan(group_spec(k, cfg.worker_counts()[k], paths, "py")).materialize()
               for k in ("model", "generation", "rollout", "master")}
    assert "--gpus-per-node=2\n" in scripts["model"] and "GPUS_PER_TASK=1\n" in scripts["model"]
    assert "--gpus-per-node=8\n" in scripts["generation"]
    assert "RLSYS_GPUS_PER_TASK=4\n" in scripts["generation"]
    assert "gpus-per-node" not in scripts["rollout"] + scripts["master"]
