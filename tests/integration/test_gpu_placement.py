"""GPU placement under the local scheduler, asserted on real worker processes: fake GPU ids
(no CUDA needed) given through the config or the launcher's CUDA_VISIBLE_DEVICES reach each
worker as its own CUDA_VISIBLE_DEVICES (smoke reports every worker's environment)."""
from __future__ import annotations

from tests.helpers import read_summary, run_launch

# (a 2 s heartbeat expired under CI's load, beside an arith-tiny trial on the other xdist
# worker; placement is what these test, and a 10 s one costs them nothing)
FAST = ["controller.heartbeat_ttl=10", "scheduler.stop_grace=3", "controller.progress=false",
        "rollout.count=2", "smoke.trajectories_per_worker=20"]


def _visible(fileroot: str, trial: str) -> dict[str, str | None]:
    s = read_summary(fileroot, "smoke", trial)
    assert s["status"] == "completed"
    return {w: p["CUDA_VISIBLE_DEVICES"] for w, p in s["results"]["placement"].items()}


def test_local_workers_get_their_own_gpus_from_config(fileroot):
    r = run_launch("exp=smoke", "trial=gpus", f"cluster.fileroot={fileroot}", *FAST,
                   "model.count=2", "generation.count=2", "smoke.generation_gpus=2",
                   "scheduler.local.gpus=3,5,6,9,11,12,13")
    assert r.returncode == 0, r.stderr
    assert _visible(fileroot, "gpus") == {
        "model/0": "3", "model/1": "5", "generation/0": "6,9", "generation/1": "11,12",
        "master/0": "", "rollout/0": "", "rollout/1": ""}


def test_local_placement_respects_the_launchers_non_contiguous_devices(fileroot):
    r = run_launch("exp=smoke", "trial=env", f"cluster.fileroot={fileroot}", *FAST,
                   "model.count=3", "generation.count=1",
                   env={"CUDA_VISIBLE_DEVICES": "7,2,5,0"})
    assert r.returncode == 0, r.stderr
    got = _visible(fileroot, "env")
    assert [got[f"model/{i}"] for i in range(3)] == ["7", "2", "5"]
    assert got["generation/0"] == "0" and got["master/0"] == got["rollout/0"] == ""


def test_local_refuses_too_few_gpus_in_one_line(fileroot):
    r = run_launch("exp=smoke", "trial=few", f"cluster.fileroot={fileroot}", *FAST,
                   "model.count=2", "generation.count=1", "smoke.generation_gpus=2",
                   env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "needs 4 GPUs" in lines[0] and "model.count" in lines[0]
    assert "generation.count x smoke.generation_gpus" in lines[0]


def test_one_gpu_shared_when_asked(fileroot):
    r = run_launch("exp=smoke", "trial=share", f"cluster.fileroot={fileroot}", *FAST,
                   "model.count=2", "generation.count=1", "scheduler.local.share_gpus=true",
                   env={"CUDA_VISIBLE_DEVICES": "6"})
    assert r.returncode == 0, r.stderr
    got = _visible(fileroot, "share")
    assert got["model/0"] == got["model/1"] == got["generation/0"] == "6"


def test_rl_model_workers_sharing_a_gpu_are_refused_in_one_line(fileroot):
    r = run_launch("exp=arith-tiny", "trial=share", f"cluster.fileroot={fileroot}",
                   "model.count=2", "scheduler.local.share_gpus=true",
                   env={"CUDA_VISIBLE_DEVICES": "6"})
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "model/0 and model/1 would share GPU 6" in lines[0]
    assert "model.count" in lines[0] and "scheduler.local.share_gpus=true" in lines[0]
