"""Start-up that knows the queue, on real Slurm: a busy partition is waited for (queue time does
not count toward registration), requests that can never run fail in one line before anything is
queued, and ``scheduler.slurm.hetjob=true`` starts every group as one heterogeneous job."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.helpers import overridden, read_summary, run_launch
from tests.scheduler import slurm_shims
from tests.scheduler.slurm_shims import requeue_setting
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


def test_a_component_of_a_heterogeneous_job_stopped_alone_turns_the_jobs_requeue_off(
        slurm_cluster_4n, tmp_path, monkeypatch, caplog):
    """A stateful recovery stops one group of a heterogeneous job (``hetjob=true``): Slurm
    cannot cancel one component, so it is forgotten and the job (its leader) set never to
    requeue. Its first ``scontrol update`` cannot reach Slurm here (as while slurmctld
    restarts): the job is asked again once Slurm answers a poll, though that component is no
    longer tracked (the job runs on for the others)."""
    from scheduler import slurm_updates
    from scheduler.base import GroupSpec, JobState
    from scheduler.slurm import SlurmScheduler
    from scheduler.slurm_config import SlurmConfig
    from tests.helpers import REPO
    from tests.scheduler.test_slurm_e2e import wait_for

    for k, v in slurm_cluster_4n.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(slurm_updates, "RETRY_EVERY", 0.0)
    sched = SlurmScheduler(SlurmConfig(poll_interval=0.2, hetjob=True), "stop", "het",
                           str(tmp_path), REPO)
    groups = [GroupSpec(kind, 1, ("sleep", "300"), {}, (str(tmp_path / f"{kind}-0.log"),))
              for kind in ("model", "rollout")]
    (request,) = sched.plan_all(groups)
    ids = sched.schedule(request)
    leader = ids[0].split("+")[0]
    shim = slurm_shims.shim(tmp_path, "scontrol", 1, only="update")

    try:
        wait_for(lambda: [s.state for s in sched.poll(fresh=True)] == [JobState.RUNNING] * 2,
                 60, "both components running")
        assert requeue_setting(leader) == "Requeue=1"
        monkeypatch.setenv("PATH", f"{shim.bin_dir}:{os.environ['PATH']}")
        sched.stop_group("rollout", grace=3)
        assert f"job {leader} may still be requeued" in caplog.text
        # should the job requeue all the same, its copy of rollout/0 exits
        assert (tmp_path / f".requeue-rollout-{ids[1]}.forgotten-0").exists()
        assert [s.job_id for s in sched.poll(fresh=True)] == [ids[0]]  # the model's, running
        wait_for(lambda: sched.poll(fresh=True) and requeue_setting(leader) == "Requeue=0", 60,
                 "Requeue=0 taken")
        assert sched._updates.unsettled == []
        assert shim.count() == 2  # (not asked again once taken)
        sched.stop_group("model", grace=3)  # the last component: the job is cancelled
        wait_for(lambda: not our_jobs(slurm_cluster_4n.env, "stop", "het"), 60, "no job left")
    finally:
        subprocess.run(["scancel", leader])


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
