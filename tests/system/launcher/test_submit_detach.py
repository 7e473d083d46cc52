"""``--detach`` refuses a trial whose controller job is still in the Slurm queue (an earlier
``--detach`` not yet started holds no lock): the decision over squeue's lines is pure."""
from __future__ import annotations

from scheduler.slurm_jobs import parse_named
from system.launcher.config import ExperimentConfig
from system.launcher.submit import live_controller, refusal

NAME = "smoke_t1:controller"
LOG = "/r/fa/smoke/t1/logs/controller.log"


def _jobs(*lines: str):
    return parse_named("".join(f"{line}\n" for line in lines))


def test_parse_named():
    (j,) = _jobs("29|PENDING|smoke_t1:controller|/r/a b|c/logs/controller.log")
    assert (j.job_id, j.state, j.name, j.stdout) == (
        "29", "PENDING", NAME, "/r/a b|c/logs/controller.log")
    assert parse_named("\n  \nbad line\n") == []


def test_a_queued_controller_of_this_trial_is_found():
    for state in ("PENDING", "RUNNING", "REQUEUE_HOLD", "SUSPENDED"):
        found = live_controller(_jobs(f"29|{state}|{NAME}|{LOG}"), NAME, {LOG})
        assert found is not None and found.job_id == "29"


def test_others_are_not_this_trials_controller():
    assert live_controller([], NAME, {LOG}) is None
    other_root = f"30|PENDING|{NAME}|/r/fb/smoke/t1/logs/controller.log"
    ending = f"31|COMPLETING|{NAME}|{LOG}"  # its controller has exited
    worker = f"32|PENDING|smoke_t1:model|{LOG}"
    relative = f"33|PENDING|{NAME}|logs/controller.log"
    assert live_controller(_jobs(other_root, ending, worker, relative), NAME, {LOG}) is None
    found = live_controller(_jobs(other_root, f"34|PENDING|{NAME}|{LOG}"), NAME, {LOG})
    assert found is not None and found.job_id == "34"


def test_percent_in_the_file_root():
    log = "/r/50%/smoke/t1/logs/controller.log"  # Slurm 22.05 shows the pattern: % doubled
    assert live_controller(_jobs(f"29|PENDING|{NAME}|/r/50%%/smoke/t1/logs/controller.log"),
                           NAME, {log}) is not None
    assert live_controller(_jobs(f"29|PENDING|{NAME}|{log}"), NAME, {log}) is not None


def test_refusal_is_one_line_naming_the_job_and_the_cancel():
    cfg = ExperimentConfig(exp="smoke", trial="t1")
    (job,) = _jobs(f"29|PENDING|{NAME}|{LOG}")
    text = refusal(cfg, job)
    assert "\n" not in text and "job 29, PENDING" in text and "scancel 29" in text
    assert "python -m system.ctl cancel exp=smoke trial=t1 cluster.fileroot=" in text
