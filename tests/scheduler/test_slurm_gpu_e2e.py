"""GPU placement on a real Slurm with fake GPUs (character devices, so Slurm sets
``CUDA_VISIBLE_DEVICES`` per step): each worker's devices and ranks as its process saw them
(smoke reports them), on one node and on two (``slurmd -N``), and a 2-node model job that trains.

    .venv/bin/python -m pytest -q tests/scheduler/test_slurm_gpu_e2e.py          # all (slow: RL)
    .venv/bin/python -m pytest -q tests/scheduler/test_slurm_gpu_e2e.py -m "not slow"
"""
from __future__ import annotations

import glob
import os

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import read_summary, run_launch

pytestmark = pytest.mark.slurm

GPU_SLURM = ["scheduler=slurm", "cluster.interface=127.0.0.1", "scheduler.slurm.poll_interval=0.5",
             "scheduler.slurm.gpus=true", "controller.heartbeat_ttl=15", "scheduler.stop_grace=3",
             "controller.progress=false"]
SMOKE = ["exp=smoke", "rollout.count=2", "smoke.trajectories_per_worker=20"]
"""(Placement only: no failure is detected here, so a 15 s heartbeat, which a loaded 2-core
CI machine keeps more easily than 3 s: a run saw a model worker's expire.)"""


def _char_gpus(cluster) -> None:
    if not cluster.char_gpus:
        pytest.skip("mknod was refused: the fake GPUs are plain files and Slurm sets no "
                    "CUDA_VISIBLE_DEVICES")


def _placement(root: str, exp: str, trial: str) -> dict[str, dict]:
    s = read_summary(root, exp, trial)
    assert s["status"] == "completed", s
    return s["results"]["placement"]


def _devices(p: dict) -> list[str]:
    return (p["CUDA_VISIBLE_DEVICES"] or "").split(",") if p["CUDA_VISIBLE_DEVICES"] else []


def test_each_worker_gets_its_own_gpus_on_one_node(slurm_cluster, fileroot):
    """2 model workers (1 GPU each) and a generation server of 2 GPUs fill the node's 4."""
    _char_gpus(slurm_cluster)
    r = run_launch(*SMOKE, "trial=gpu1", f"cluster.fileroot={fileroot}", *GPU_SLURM,
                   "model.count=2", "generation.count=1", "smoke.generation_gpus=2",
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    p = _placement(fileroot, "smoke", "gpu1")
    model = [_devices(p[f"model/{i}"]) for i in range(2)]
    gen = _devices(p["generation/0"])
    assert [len(d) for d in model] == [1, 1] and len(gen) == 2, p
    every = [d for ds in (*model, gen) for d in ds]
    assert len(set(every)) == 4 and set(every) <= {"0", "1", "2", "3"}, p  # no GPU shared
    for i in range(2):
        m = p[f"model/{i}"]
        assert (m["RANK"], m["LOCAL_RANK"], m["WORLD_SIZE"]) == (str(i), str(i), "2"), m
        assert m["MASTER_ADDR"] == slurm_cluster.node_names[0]


def test_placement_and_ranks_across_two_nodes(slurm_cluster_2n, fileroot):
    """4 model workers over 2 nodes (2 each) and 2 generation servers of 2 GPUs (1 per node):
    each node's 4 GPUs are shared out with none twice; ranks, local ranks and the master
    address follow the tasks; the model workers' gloo all-reduce spans both nodes."""
    _char_gpus(slurm_cluster_2n)
    r = run_launch(*SMOKE, "trial=gpu2", f"cluster.fileroot={fileroot}", *GPU_SLURM,
                   "model.count=4", "scheduler.slurm.model.nodes=2", "generation.count=2",
                   "scheduler.slurm.generation.nodes=2", "smoke.generation_gpus=2",
                   env=slurm_cluster_2n.env, timeout=300)
    assert r.returncode == 0, r.stderr
    s = read_summary(fileroot, "smoke", "gpu2")
    assert s["results"]["allreduce_ok"] is True
    p = _placement(fileroot, "smoke", "gpu2")
    nodes = slurm_cluster_2n.node_names
    for i in range(4):
        m = p[f"model/{i}"]
        assert m["SLURMD_NODENAME"] == nodes[i // 2], m
        assert (m["RANK"], m["LOCAL_RANK"], m["WORLD_SIZE"], m["LOCAL_WORLD_SIZE"]) == \
            (str(i), str(i % 2), "4", "2"), m
        assert m["MASTER_ADDR"] == nodes[0] and m["MASTER_PORT"], m
        assert len(_devices(m)) == 1, m
    assert {p[f"generation/{i}"]["SLURMD_NODENAME"] for i in range(2)} == set(nodes)
    for node in nodes:
        here = [w for w, q in p.items() if q["SLURMD_NODENAME"] == node
                and w.split("/")[0] in ("model", "generation")]
        devs = [d for w in here for d in _devices(p[w])]
        assert len(devs) == 4 and len(set(devs)) == 4, (node, {w: p[w] for w in here})


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny",
                                                    "config.json")),
                    reason="the arith-tiny model is created by scripts/setup.sh")
def test_two_node_model_job_trains(slurm_cluster_2n, fileroot):
    """arith-tiny with its 2 model workers (FSDP2 over gloo) in one job on 2 nodes, each with
    its own fake GPU: the trial trains every step and completes."""
    _char_gpus(slurm_cluster_2n)
    r = run_launch("exp=arith-tiny", "trial=nodes2", f"cluster.fileroot={fileroot}", *GPU_SLURM,
                   "model.count=2", "scheduler.slurm.model.nodes=2", "generation.count=1",
                   "rollout.count=1", "rl.total_steps=4", "rl.batch_size=4", "rl.group_size=4",
                   "rl.task.train_size=16", "rl.task.eval_size=8", "rl.eval_interval=0",
                   "rl.save_interval_s=0", "rl.save_overhead=0",
                   env=slurm_cluster_2n.env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    s = read_summary(fileroot, "arith-tiny", "nodes2")
    assert s["status"] == "completed" and s["steps"] == 4, s
    logs = glob.glob(os.path.join(fileroot, "arith-tiny", "nodes2", "logs", "slurm-model-*.log"))
    assert logs, "no batch log of the model job"
    with open(logs[0]) as f:
        started = [line for line in f if " start (restart 0) on " in line]
    assert started and started[0].rstrip().endswith(" on rlnode[0-1]"), started
