"""The RL experiment on a real Slurm whose controller stalls during a recovery: the ``sbatch``
that restarts a dead worker times out, yet Slurm queues its job once it answers again."""
from __future__ import annotations

import os
import signal
import subprocess

from tests.helpers import overridden, read_summary, trial_name_resolve
from tests.integration import test_rl_slurm
from tests.integration.test_rl_slurm import SMALL, _cancel, _rl_trial, _steps, _until
from tests.scheduler.test_slurm_e2e import SLURM, squeue, wait_for
from tests.scheduler.test_slurm_stop import _wait_none_completing

pytestmark = test_rl_slurm.pytestmark


def test_a_recovery_whose_sbatch_timed_out_takes_the_job_slurm_queued_all_the_same(
        slurm_cluster, tmp_path):
    """rollout/1 is killed while slurmctld stalls (here: stopped). Its restart's ``sbatch``
    times out ("Socket timed out"), and the search of the queue after it finds nothing while
    Slurm still does not answer: the recovery fails, which is one more failure of rollout/1,
    not the trial's end. Slurm then answers and queues that job all the same; the recovery's
    next attempt takes it (or, had its look come before Slurm queued it, cancels it as a late
    copy of its own new job). Either way rollout/1 runs in one job of its own, never two, and
    training goes on."""
    root = str(tmp_path / "runs")
    trial_root = os.path.join(root, "arith-tiny", "stall")
    env = {**os.environ, **slurm_cluster.env}
    with open(os.path.join(slurm_cluster.root, "slurmctld.pid")) as f:
        ctld = int(f.read())
    with _rl_trial(slurm_cluster, root, "stall", "rl.total_steps=100000",
                   *overridden(SLURM, *SMALL, "controller.heartbeat_ttl=4",
                               "scheduler.stop_grace=2"),
                   "recover.retries=3") as (proc, err):
        (first,) = [j for j, n, _ in squeue(env, "arith-tiny", "stall")
                    if n.endswith(":rollout")]
        nr = trial_name_resolve(root, "arith-tiny", "stall")
        pid = int(nr.get("arith-tiny/stall/alive/rollout/1").split(":")[1])
        nr.close()
        _wait_none_completing()
        os.kill(ctld, signal.SIGSTOP)
        try:
            os.kill(pid, signal.SIGKILL)
            _until(proc, err, lambda: "the recovery of rollout/1 failed: sbatch could not "
                   "reach Slurm's controller" in err.text, 240, "the failed recovery")
        finally:
            os.kill(ctld, signal.SIGCONT)
        _until(proc, err, lambda: "rejoined: rollout/1" in err.text, 180,
               "rollout/1 to rejoin")
        step = max(_steps(trial_root))
        _until(proc, err, lambda: max(_steps(trial_root)) > step + 3, 120, "more steps")
        assert [j for j, n, _ in squeue(env, "arith-tiny", "stall")
                if n.endswith(":rollout")] == [first]  # (rollout/0 runs on in it)
        assert len(_respawned(env)) == 1, (_respawned(env), err.text[-4000:])  # no second copy
        # the job Slurm queued for the timed-out sbatch: taken, or cancelled as a late copy
        assert ("queued though its sbatch timed out, is taken as" in err.text
                or "also queued for the rollout group by an earlier sbatch that timed out: "
                "cancelled" in err.text), err.text[-4000:]
        # rollout/1 was forgotten in the group's job while Slurm did not answer: that job is
        # set never to requeue all the same (its requeue would start the old rollout/1 again)
        show = subprocess.run(["scontrol", "show", "job", first], capture_output=True,
                              text=True, env=env, check=True).stdout
        assert "Requeue=0" in show.split(), show
        _cancel(env, root, "stall")
        proc.wait(timeout=120)
    s = read_summary(root, "arith-tiny", "stall")
    assert s["status"] == "cancelled", s["status"]
    recs = s["recoveries"]
    assert [r["worker"] for r in recs] == ["rollout/1", "rollout/1"], recs
    assert "the recovery of rollout/1 failed: sbatch could not reach" in recs[1]["cause"], recs
    assert all(not r["stateful"] and r["steps_lost"] == 0 for r in recs), recs
    wait_for(lambda: squeue(env, "arith-tiny", "stall") == [] and _respawned(env) == [], 60,
             "an empty queue")


def _respawned(env: dict) -> list[str]:
    """Ids of the queued jobs of rollout/1 restarted alone (named after it)."""
    r = subprocess.run(["squeue", "-h", "-n", "arith-tiny_stall:rollout.1", "-o", "%i"],
                       capture_output=True, text=True, env=env, check=True)
    return r.stdout.split()
