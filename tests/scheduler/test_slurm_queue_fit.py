"""Pending reasons that never clear, and the co-scheduling fit check (pure)."""
from __future__ import annotations

import pytest

from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from scheduler.slurm_fit import Node, co_schedule_problem, parse_nodes
from scheduler.slurm_queue import blocked_message, hopeless, unavailable_nodes
from scheduler.slurm_render import group_demand
from system.errors import ConfigError

NODE_LINE = ("NodeName=gpu01 Arch=x86_64 CPUAlloc=0 CPUEfctv=16 CPUTot=16 Gres=gpu:a100:4(S:0-1) "
             "RealMemory=128000 State=IDLE Partitions=gpu,all")


@pytest.mark.parametrize("reason,keys", [
    ("PartitionConfig", ("partition",)), ("InvalidQOS", ("qos",)),
    ("InvalidAccount", ("account",)), ("PartitionTimeLimit", ("time",)),
    ("QOSMaxCpuPerJobLimit", ("cpus_per_task", "qos")),
    ("QOSMaxGRESPerJob", ("gpus_per_node", "qos")),
    ("AssocMaxNodesPerJobLimit", ("nodes", "account")),
])
def test_reasons_that_never_clear_name_their_keys(reason, keys):
    meaning, got = hopeless(reason)
    assert set(keys) <= set(got) and meaning
    line = blocked_message("model", "12", reason, meaning, got)
    assert "\n" not in line and "the model group" in line and reason in line
    assert f"scheduler.slurm.model.{keys[0]}" in line


@pytest.mark.parametrize("reason", ["Resources", "Priority", "BeginTime", "Dependency",
                                    "QOSMaxCpuPerUserLimit", "AssocGrpCpuLimit", "None", "",
                                    "ReqNodeNotAvail, UnavailableNodes:n1"])
def test_reasons_that_clear_by_waiting(reason):
    assert hopeless(reason) is None


def test_req_node_not_avail_counts_only_for_unknown_nodes():
    reason = "ReqNodeNotAvail, UnavailableNodes:n[1-2],n7"
    assert unavailable_nodes(reason) == ["n[1-2]", "n7"]
    assert hopeless(reason, unknown_nodes=True)[1] == ("nodelist", "exclude")


def test_parse_nodes_reads_cpus_gpus_memory_partitions():
    (n,) = parse_nodes(NODE_LINE)
    assert (n.name, n.cpus, n.gpus, n.mem_mb, n.partitions) == ("gpu01", 16, 4, 128000,
                                                                 ("gpu", "all"))


def _demands(slurm: SlurmConfig, counts: dict[str, int], gpus: dict[str, int]):
    return [group_demand(k, c, slurm, gpus.get(k, 0), "gpu") for k, c in counts.items()]


COUNTS = {"master": 1, "model": 2, "generation": 1, "rollout": 2}


def test_groups_that_each_fit_but_never_together_are_named():
    """The issue's case: model and generation at 6 CPUs per task on one 16-CPU node."""
    slurm = SlurmConfig(model=SlurmGroupConfig(cpus_per_task=6),
                        generation=SlurmGroupConfig(cpus_per_task=6))
    one = [Node("gpu01", 16, 4, 128000, ("gpu",))]
    problem = co_schedule_problem(_demands(slurm, COUNTS, {}), one, hetjob=False)
    assert problem and "\n" not in problem
    assert "the model and generation groups can never run at once" in problem
    assert "scheduler.slurm.model.cpus_per_task" in problem and "CPUs" in problem
    two = one + [Node("gpu02", 16, 4, 128000, ("gpu",))]
    assert co_schedule_problem(_demands(slurm, COUNTS, {}), two, hetjob=False) is None


def test_gpus_and_exclusive_count_per_node():
    slurm = SlurmConfig(gpus=True)
    nodes = [Node("a", 64, 4, 0, ("gpu",))]
    assert co_schedule_problem(_demands(slurm, COUNTS, {"model": 1, "generation": 2}), nodes,
                               False) is None  # 2 + 2 GPUs on one node
    problem = co_schedule_problem(_demands(slurm, {**COUNTS, "model": 4},
                                           {"model": 1, "generation": 2}), nodes, False)
    assert "GPUs" in problem and "gpus_per_node" in problem
    excl = SlurmConfig(rollout=SlurmGroupConfig(exclusive=True))
    assert "rollout" in co_schedule_problem(_demands(excl, COUNTS, {}), nodes, False)


def test_hetjob_needs_a_node_per_component():
    slurm = SlurmConfig(hetjob=True)
    two = [Node(f"n{i}", 32, 4, 16000, ("gpu",)) for i in range(2)]
    problem = co_schedule_problem(_demands(slurm, COUNTS, {}), two, hetjob=True)
    assert "hetjob=true can never start on partition gpu" in problem
    assert "never share a node" in problem and "scheduler.slurm.hetjob=false" in problem
    four = two + [Node(f"m{i}", 32, 4, 16000, ("gpu",)) for i in range(2)]
    assert co_schedule_problem(_demands(slurm, COUNTS, {}), four, hetjob=True) is None


def test_a_group_alone_too_big_and_other_partitions():
    slurm = SlurmConfig(rollout=SlurmGroupConfig(gpus_per_node=8))
    nodes = [Node("a", 16, 4, 0, ("gpu",)), Node("b", 16, 8, 0, ("big",))]
    problem = co_schedule_problem(_demands(slurm, COUNTS, {}), nodes, False)
    assert problem.startswith("the rollout group can never run on partition gpu")
    moved = SlurmConfig(rollout=SlurmGroupConfig(gpus_per_node=8, partition="big"))
    assert co_schedule_problem(_demands(moved, COUNTS, {}), nodes, False) is None


def test_queue_timeout_is_validated():
    with pytest.raises(ConfigError, match="queue_timeout"):
        SlurmConfig(queue_timeout=-1)


def test_a_hold_after_a_launch_failure_is_told_from_deliberate_holds():
    from scheduler.slurm_queue import held_after_launch_failure

    assert held_after_launch_failure("launch failed requeued held")
    assert held_after_launch_failure("Launch failed requeued held ")
    for reason in ("JobHeldAdmin", "JobHeldUser", "BeginTime", "Priority", ""):
        assert not held_after_launch_failure(reason)
