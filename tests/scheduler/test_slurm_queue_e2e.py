"""Start-up that knows the queue, on real Slurm: a busy partition is waited for (queue time does
not count toward registration), requests that can never run fail in one line before anything is
queued, and ``scheduler.slurm.hetjob=true`` starts every group as one heterogeneous job."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.helpers import overridden, read_summary, run_launch
from tests.scheduler.test_slurm_e2e import SLURM

pytestmark = pytest.mark.slurm

SLOW_OK = ("controller.heartbeat_ttl=15",)
"""The whole trials run beside other work on a small machine: a 3 s heartbeat is too tight."""


def our_jobs(env: dict, exp: str, trial: str) -> list[str]:
    """Every job of the trial still in the queue, by name (``<exp>_<trial>:...``)."""
    r = subprocess.run(["squeue", "-h", "-o", "%i|%j"], capture_output=True, text=True,
                       env={**os.environ, **env}, check=True)
    return [line for line in r.stdout.split() if f"|{exp}_{trial}:" in line]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def refused(cluster, root: str, trial: str, *extra: str) -> tuple[str, float]:
    t0 = time.monotonic()
    r = run_launch("exp=smoke", f"trial={trial}", f"cluster.fileroot={root}",
                   *overridden(SLURM, *extra),
                   env=cluster.env, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = error_lines(r.stderr)
    assert our_jobs(cluster.env, "smoke", trial) == []
    assert read_summary(root, "smoke", trial)["status"] == "failed"
    return line, took


def test_a_request_that_can_never_run_fails_in_one_line(slurm_cluster, tmp_path):
    """8 GPUs per node on 4-GPU nodes: sbatch --test-only refuses it before anything is
    queued."""
    line, took = refused(slurm_cluster, str(tmp_path / "runs"), "gpu8",
                         "scheduler.slurm.rollout.gpus_per_node=8")
    assert took < 60
    assert "the rollout group can never run" in line, line
    assert "scheduler.slurm.rollout.gpus_per_node=8" in line and "not available" in line, line


def test_groups_that_never_fit_together_are_refused(slurm_cluster, tmp_path):
    """Model (2 x 12 CPUs) and generation (2 x 12 CPUs) each fit the 32-CPU node, not both;
    and a heterogeneous job can never start on one node."""
    root = str(tmp_path / "runs")
    line, _ = refused(slurm_cluster, root, "pair", "scheduler.slurm.model.cpus_per_task=12",
                      "scheduler.slurm.generation.cpus_per_task=12")
    assert "the model and generation groups can never run at once on partition debug" in line
    assert "scheduler.slurm.model.cpus_per_task" in line, line
    r = run_launch("exp=smoke", "trial=pairdry", f"cluster.fileroot={root}", *SLURM, "--test-only",
                   "scheduler.slurm.model.cpus_per_task=12",
                   "scheduler.slurm.generation.cpus_per_task=12", env=slurm_cluster.env)
    assert r.returncode == 1 and "# pre-flight: REFUSED: the model and generation" in r.stdout
    line, _ = refused(slurm_cluster, root, "het1", "scheduler.slurm.hetjob=true")
    assert "hetjob=true can never start on partition debug" in line, line


@pytest.mark.slow
def test_a_busy_partition_is_waited_for(slurm_cluster, tmp_path):
    """Another job holds the whole node for 40 s: the trial's jobs pend (reason shown), the
    20 s register timeout does not run meanwhile, and the trial completes once it is free."""
    env = {**os.environ, **slurm_cluster.env}
    blocker = subprocess.run(["sbatch", "--parsable", "--exclusive", "--job-name=blocker",
                              "--output=/dev/null", "--wrap", "sleep 40"], capture_output=True,
                             text=True, env=env, check=True).stdout.strip()
    try:
        root = str(tmp_path / "runs")
        r = run_launch("exp=smoke", "trial=busy", f"cluster.fileroot={root}",
                       *overridden(SLURM, *SLOW_OK),
                       "controller.register_timeout=20", env=slurm_cluster.env,
                       timeout=240)
        assert r.returncode == 0, r.stderr
        assert "waiting in the queue: the model group's job" in r.stderr, r.stderr
        assert "(reason Resources)" in r.stderr or "(reason Priority)" in r.stderr, r.stderr
        s = read_summary(root, "smoke", "busy")
        assert s["status"] == "completed"
        assert s["timeline_s"]["registered"] - s["timeline_s"]["submitted"] > 20  # queued
    finally:
        subprocess.run(["scancel", blocker], env=env)


@pytest.fixture(scope="module")
def slurm_cluster_4n(tmp_path_factory):
    """Four nodes: a heterogeneous job's components never share one, and smoke has 4 groups."""
    from slurm.testcluster.cluster import SlurmTestCluster

    why = SlurmTestCluster.available()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    cluster = SlurmTestCluster(str(tmp_path_factory.mktemp("slurm4n")), cpus=8, nodes=4)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.slow
def test_every_group_as_one_heterogeneous_job(slurm_cluster_4n, tmp_path):
    root = str(tmp_path / "runs")
    r = run_launch("exp=smoke", "trial=het", f"cluster.fileroot={root}", *overridden(SLURM, *SLOW_OK),
                   "scheduler.slurm.hetjob=true", env=slurm_cluster_4n.env,
                   timeout=240)
    assert r.returncode == 0, r.stderr
    s = read_summary(root, "smoke", "het")
    assert s["status"] == "completed" and s["results"]["trajectories_valid"] == 400
    leaders = {ids[0].split("+")[0] for ids in s["jobs"].values()}
    offsets = sorted(ids[0].split("+")[1] for ids in s["jobs"].values())
    assert len(leaders) == 1 and offsets == ["0", "1", "2", "3"], s["jobs"]
    assert s["results"]["model_gpus_on_node"] == [2, 2]
    assert our_jobs(slurm_cluster_4n.env, "smoke", "het") == []


def test_a_pending_reason_that_never_clears_fails_at_once(slurm_cluster, tmp_path):
    """The partition's time limit (lowered here) is below the rollout job's: sbatch takes it
    (EnforcePartLimits=NO) and it pends with PartitionTimeLimit, which waiting never clears."""
    env = {**os.environ, **slurm_cluster.env}
    subprocess.run(["scontrol", "update", "PartitionName=debug", "MaxTime=10"], env=env,
                   check=True)
    try:
        line, took = refused(slurm_cluster, str(tmp_path / "runs"), "ptime",
                             "scheduler.slurm.rollout.time=20")
    finally:
        subprocess.run(["scontrol", "update", "PartitionName=debug", "MaxTime=INFINITE"],
                       env=env, check=True)
    assert took < 60
    assert "the rollout group can never start" in line, line
    assert "PartitionTimeLimit" in line or "PartitionConfig" in line, line
    assert "scheduler.slurm.rollout.time" in line, line
