"""GPU placement, pure: the local plan, its refusal, a Slurm task's slice and ranks; and the
local scheduler's per-worker environment built from it."""
from __future__ import annotations

import pytest

from scheduler.gpu_plan import (GpuDemand, GpuPlanError, expand_nodelist, parse_visible,
                                plan_gpus, task_devices, task_env)
from scheduler.local import LocalGpus, LocalScheduler, local_gpus
from system.errors import ConfigError
from system.launch import build_config
from system.launcher.groups import group_spec
from system.paths import TrialPaths

MODEL2_GEN2_TP2 = [GpuDemand("model", 2, 1, "model.count"),
                   GpuDemand("generation", 2, 2, "generation.count x tp")]


def test_each_worker_gets_its_own_gpus_in_demand_order():
    plan = plan_gpus(("0", "1", "2", "3", "4", "5"), MODEL2_GEN2_TP2)
    assert plan == {"model/0": ("0",), "model/1": ("1",), "generation/0": ("2", "3"),
                    "generation/1": ("4", "5")}


def test_non_contiguous_visible_ids_map_onto_those_devices():
    plan = plan_gpus(parse_visible("7, 2,5,GPU-aa11,3,6"), MODEL2_GEN2_TP2)
    assert plan["model/0"] == ("7",) and plan["model/1"] == ("2",)
    assert plan["generation/0"] == ("5", "GPU-aa11") and plan["generation/1"] == ("3", "6")
    devices = [d for ids in plan.values() for d in ids]
    assert len(devices) == len(set(devices))  # no device shared


def test_spare_gpus_stay_unused_and_kinds_without_demand_see_none():
    plan = plan_gpus(("0", "1", "2", "3"), [GpuDemand("model", 1, 1, "model.count"),
                                            GpuDemand("generation", 1, 1, "generation.count"),
                                            GpuDemand("rollout", 2, 0, "-")])
    assert plan == {"model/0": ("0",), "generation/0": ("1",), "rollout/0": (), "rollout/1": ()}


def test_too_few_gpus_is_one_line_naming_the_keys():
    with pytest.raises(GpuPlanError) as e:
        plan_gpus(("0", "2", "5"), MODEL2_GEN2_TP2)
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs 6 GPUs" in msg and "3 visible (0,2,5)" in msg
    assert "model.count" in msg and "generation.count x tp" in msg
    assert "scheduler.local.gpus" in msg and "scheduler.local.share_gpus=true" in msg
    assert "scheduler.local.gpus=none" in msg


def test_sharing_wraps_around_but_never_gives_one_worker_a_device_twice():
    plan = plan_gpus(("4",), [GpuDemand("model", 1, 1, "model.count"),
                              GpuDemand("generation", 1, 1, "generation.count")], share=True)
    assert plan == {"model/0": ("4",), "generation/0": ("4",)}
    plan = plan_gpus(("0", "1", "2"), MODEL2_GEN2_TP2, share=True)
    assert plan["generation/0"] == ("2", "0") and plan["generation/1"] == ("1", "2")
    with pytest.raises(GpuPlanError, match="needs 2 GPUs for one worker"):
        plan_gpus(("0",), MODEL2_GEN2_TP2, share=True)


def test_sharing_never_puts_two_workers_of_an_exclusive_kind_on_one_gpu():
    model = GpuDemand("model", 2, 1, "model.count", exclusive=True)
    gen = GpuDemand("generation", 1, 1, "generation.count")
    # two GPUs: each model worker its own, the server shares one (its weight sync falls back
    # to gloo, see system.reshard.backend)
    assert plan_gpus(("0", "1"), [model, gen], share=True) == {
        "model/0": ("0",), "model/1": ("1",), "generation/0": ("0",)}
    with pytest.raises(GpuPlanError) as e:
        plan_gpus(("7",), [model, gen], share=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("model/0 and model/1 would share GPU 7 "
                          "(scheduler.local.share_gpus=true with 2 x 1 (model.count) on 1 visible)")
    assert "NCCL refuses two ranks on one GPU" in msg and "lower model.count to at most 1" in msg
    # a kind that is not exclusive (the smoke test's model workers use gloo on the CPU) shares
    assert plan_gpus(("7",), [GpuDemand("model", 2, 1, "model.count"), gen], share=True) == {
        "model/0": ("7",), "model/1": ("7",), "generation/0": ("7",)}


def test_parse_visible_follows_cuda():
    assert parse_visible("") == () and parse_visible(" , ") == ()
    assert parse_visible("3,1,-1,2") == ("3", "1")  # CUDA ignores devices after an invalid one
    assert parse_visible("MIG-1a2b,GPU-ff") == ("MIG-1a2b", "GPU-ff")
    with pytest.raises(ConfigError, match="twice"):
        parse_visible("1,1")
    with pytest.raises(ConfigError, match="not valid"):
        parse_visible("1;rm -rf /")


def test_task_slices_by_local_rank():
    node = ("4", "5", "6", "7")
    assert task_devices(node, 0, 1) == ("4",) and task_devices(node, 3, 1) == ("7",)
    assert task_devices(node, 1, 2) == ("6", "7")
    assert task_devices(("6",), 3, 1) == ("6",)  # Slurm already bound the task
    with pytest.raises(GpuPlanError, match="local rank 2 needs GPUs 4..5"):
        task_devices(node, 2, 2)


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,7],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]
    assert expand_nodelist("rlnode[0-1]") == ["rlnode0", "rlnode1"]
    assert expand_nodelist("host") == ["host"]


def slurm_env(**kw: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_JOB_NODELIST": "rlnode[0-1]", "CUDA_VISIBLE_DEVICES": "0,1"}
    return {**env, **kw}


def test_task_env_ranks_master_and_own_gpu():
    env = task_env(slurm_env(RLSYS_GPUS_PER_TASK="1"))
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
                   "MASTER_ADDR": "rlnode0", "MASTER_PORT": str(20000 + 4242),
                   "CUDA_VISIBLE_DEVICES": "1"}


def test_task_env_generation_slices_and_keeps_given_master():
    env = task_env(slurm_env(RLSYS_GPUS_PER_TASK="2", CUDA_VISIBLE_DEVICES="2,3,6,7",
                             MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"


def test_task_env_without_gpus_leaves_devices_alone_and_outside_slurm_is_empty():
    assert "CUDA_VISIBLE_DEVICES" not in task_env(slurm_env())
    assert task_env({"CUDA_VISIBLE_DEVICES": "0"}) == {}


def test_task_env_of_a_lone_restart_has_its_rank_but_no_world():
    env = task_env(slurm_env(RLSYS_WORKER_BASE="5", SLURM_PROCID="0", SLURM_LOCALID="0",
                             SLURM_NTASKS="1", SLURM_TASKS_PER_NODE="1", SLURM_NODEID="0"))
    assert env["RANK"] == "5" and "WORLD_SIZE" not in env and "MASTER_ADDR" not in env


def test_task_env_refuses_a_task_without_its_gpus():
    with pytest.raises(GpuPlanError, match="gpus_per_node"):
        task_env(slurm_env(RLSYS_GPUS_PER_TASK="2", CUDA_VISIBLE_DEVICES="0,1,2"))


# --- the local scheduler --------------------------------------------------------------------

def test_local_gpus_setting():
    assert local_gpus("none", {"CUDA_VISIBLE_DEVICES": "0,1"}) == LocalGpus((), True)
    assert local_gpus("4,6", {}).ids == ("4", "6")
    assert local_gpus("auto", {"CUDA_VISIBLE_DEVICES": "3,1"}) == LocalGpus(("3", "1"), True)
    assert local_gpus("auto", {"CUDA_VISIBLE_DEVICES": ""}) == LocalGpus((), True)


def test_local_plan_sets_each_workers_devices(tmp_path):
    sched = LocalScheduler(LocalGpus(("5", "2", "9", "1", "3"), True), MODEL2_GEN2_TP2[:1] + [
        GpuDemand("generation", 1, 3, "generation.count x tp")])
    paths = TrialPaths(str(tmp_path / "t"))
    envs = {p.name: p.env["CUDA_VISIBLE_DEVICES"]
            for kind, n in (("model", 2), ("generation", 1), ("rollout", 2))
            for p in sched.plan(group_spec(kind, n, paths, "py")).processes}
    assert envs == {"model/0": "5", "model/1": "2", "generation/0": "9,1,3",
                    "rollout/0": "", "rollout/1": ""}
    # a worker restarted alone gets its devices again
    again = sched.plan(group_spec("model", 1, paths, "py", attempt=1, first=1)).processes[0]
    assert again.env["CUDA_VISIBLE_DEVICES"] == "2"


def test_local_without_gpus_leaves_the_environment_alone(tmp_path):
    sched = LocalScheduler(LocalGpus(), MODEL2_GEN2_TP2)
    (p,) = sched.plan(group_spec("model", 1, TrialPaths(str(tmp_path / "t")), "py")).processes
    assert "CUDA_VISIBLE_DEVICES" not in p.env


def test_launcher_refuses_too_few_gpus_before_starting(tmp_path):
    from scheduler.registry import make_scheduler

    cfg = build_config("arith-tiny", "t", ["scheduler.local.gpus=0,1,2", "model.count=2",
                                           "rl.vllm.tensor_parallel_size=2"])
    with pytest.raises(GpuPlanError, match=r"needs 4 GPUs.*model\.count.*"
                                           r"rl\.vllm\.tensor_parallel_size"):
        make_scheduler(cfg.scheduler, cfg.exp, cfg.trial, str(tmp_path), 0o077,
                       cfg.gpu_demands())


def test_launcher_refuses_model_workers_sharing_a_gpu_before_starting(tmp_path):
    from scheduler.registry import make_scheduler

    def scheduler(*overrides: str):
        cfg = build_config("arith-tiny", "t", ["scheduler.local.gpus=0",
                                               "scheduler.local.share_gpus=true", *overrides])
        return make_scheduler(cfg.scheduler, cfg.exp, cfg.trial, str(tmp_path), 0o077,
                              cfg.gpu_demands())
    with pytest.raises(GpuPlanError, match=r"model/0 and model/1 would share GPU 0.*"
                                           r"lower model\.count to at most 1"):
        scheduler("model.count=2")
    scheduler("model.count=1")  # the one-GPU machine: trainer and vLLM share the GPU


def test_local_gpus_config_is_validated():
    with pytest.raises(ConfigError, match="scheduler.local.gpus"):
        build_config("smoke", "t", ["scheduler.local.gpus=0,0"])
    cfg = build_config("smoke", "t", ["scheduler.local.gpus=3"])
    assert cfg.scheduler.local.gpus == "3"
