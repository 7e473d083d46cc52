"""Reading scancel's and scontrol's answers."""
from __future__ import annotations

from scheduler.slurm_jobs import _only_gone


def test_a_scancel_of_jobs_already_gone_is_no_failure():
    gone = "scancel: error: Kill job error on job id 5: Invalid job id specified\n"
    ending = "scancel: error: Kill job error on job id 6: Job/step already completing or completed\n"
    assert _only_gone(gone) and _only_gone(gone * 2) and _only_gone(gone + ending)
    assert not _only_gone("")  # failed without a word: worth a warning
    assert not _only_gone(gone + "scancel: error: Unable to contact slurm controller\n")
    assert not _only_gone("scancel: error: Access/permission denied for job 7\n")


def test_preempt_time_is_read_from_scontrol_and_only_a_recent_one_counts(monkeypatch):
    """A job chosen for preemption shows ``PreemptTime`` (local time) in ``scontrol show job``;
    one never chosen shows ``None``. Only a recent one makes a SIGTERM a preemption's: Slurm
    keeps the time after a gang suspension, and a later SIGTERM is a plain stop."""
    import subprocess
    import time

    from scheduler import slurm_jobs
    from scheduler.slurm_cli import parse_scontrol_job
    from scheduler.slurm_jobs import preempt_time, preempting

    line = ("JobId=7 JobName=x JobState=RUNNING Reason=None PreemptEligibleTime=2026-11-27T10:51:48"
            " PreemptTime=2026-11-27T10:51:52 SuspendTime=None")
    assert preempt_time(parse_scontrol_job(line)) == time.mktime((2026, 11, 27, 10, 51, 52, 0, 0,
                                                                  -1))
    assert preempt_time(parse_scontrol_job("JobId=7 PreemptTime=None")) is None
    assert preempt_time(parse_scontrol_job("JobId=7")) is None
    shown = {"out": ""}

    def scontrol(argv, timeout):
        assert argv[:4] == ["scontrol", "show", "job", "-o"] and argv[4] == "7"
        return subprocess.CompletedProcess(argv, 0, shown["out"], "")

    monkeypatch.setattr(slurm_jobs, "_run", scontrol)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    shown["out"] = f"JobId=7 PreemptTime={stamp}\n"
    assert preempting("7")
    old = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 3600))
    shown["out"] = f"JobId=7 PreemptTime={old}\n"
    assert not preempting("7")
    shown["out"] = "JobId=7 PreemptTime=None\n"
    assert not preempting("7+1")  # (a heterogeneous component: its own line, none here)
