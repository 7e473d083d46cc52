"""Pure parts of the Slurm scheduler: rendering (golden files), state mapping, parsing."""
from __future__ import annotations

import os
import subprocess

import pytest

from scheduler.base import GroupSpec, JobState
from scheduler.slurm import (STATE_TABLE, SlurmScheduler, map_state, parse_sbatch_parsable,
                             parse_scontrol_job)
from scheduler.slurm_config import (SlurmConfig, SlurmGroupConfig, check_slurm_time,
                                    slurm_time_seconds)
from scheduler.script_text import sbatch_quote
from scheduler.slurm_render import render_controller_script, render_worker_script, task_log
from system.errors import ConfigError, SchedulerError
from system.launch import build_config
from system.launcher.groups import group_spec
from system.paths import TrialPaths

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
ODD = "/shared/runs/it's a \"quoted\" dir"  # spaces, single and double quotes


def check_golden(name: str, text: str) -> None:
    path = os.path.join(GOLDEN, name)
    if os.environ.get("UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert text == f.read(), f"{name} differs from its golden file (UPDATE_GOLDEN=1 rewrites)"
    r = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


def full_config() -> SlurmConfig:
    return SlurmConfig(
        partition="gpu", account="rl-team", qos="high", time="04:00:00", signal_seconds=300,
        model=SlurmGroupConfig(
            nodes=2, gpus_per_node=8, cpus_per_task=12, mem="480G", exclusive=True,
            constraint="h100&ib", exclude="node[07-08]", extra_sbatch=["--reservation=rl"],
            setup=["module load cuda/12.4", "source /opt/env/bin/activate"],
            env={"NCCL_DEBUG": "WARN", "ODD": "a b 'c' \"d\""},
            container_image="nvcr.io#nvidia/pytorch:24.05-py3",
            container_mounts=f"{ODD}:/runs"),
        rollout=SlurmGroupConfig(partition="cpu", time="1-00:00:00", cpus_per_task=4,
                                 apptainer_image="/images/rl.sif", apptainer_args="--nv --cleanenv"),
        controller=SlurmGroupConfig(partition="cpu", mem="4G"))


def render(kind: str, count: int, slurm: SlurmConfig, attempt: int = 0, first: int = 0) -> str:
    group = group_spec(kind, count, TrialPaths(f"{ODD}/gsm8k/t1"), "/opt/py env/bin/python",
                       attempt, first)
    return render_worker_script(exp="gsm8k", trial="t1", group=group, slurm=slurm,
                                workdir="/home/a b/project", umask=0o077)


def test_golden_model_group_pyxis():
    check_golden("model.sbatch", render("model", 16, full_config()))


def test_golden_rollout_group_apptainer():
    check_golden("rollout.sbatch", render("rollout", 6, full_config()))


def test_golden_default_group():
    check_golden("master.sbatch", render("master", 1, SlurmConfig()))


def test_golden_controller():
    check_golden("controller.sbatch", render_controller_script(
        exp="gsm8k", trial="t1", slurm=full_config(),
        argv=["/opt/py env/bin/python", "-m", "system.launch", "exp=gsm8k", "trial=t1",
              f"cluster.fileroot={ODD}"],
        env={"PYTHONUNBUFFERED": "1"}, logs_dir=f"{ODD}/gsm8k/t1/logs", workdir="/home/a b/p",
        umask=0o077))


def test_sbatch_quote():
    assert sbatch_quote('a "b" \\c') == '"a \\"b\\" \\\\c"'
    with pytest.raises(ConfigError):
        sbatch_quote("a\nb")


def test_task_layout_errors():
    with pytest.raises(ConfigError, match="cannot hold"):
        render("model", 5, SlurmConfig(model=SlurmGroupConfig(nodes=2, ntasks_per_node=2)))
    with pytest.raises(ConfigError, match="empty"):
        render("model", 2, SlurmConfig(model=SlurmGroupConfig(nodes=3)))


def test_unknown_and_bad_settings_are_clear():
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", ["scheduler.slurm.model.gpus=2"])
    for valid in ("gpus_per_node", "partition", "container_image", "extra_sbatch", "env"):
        assert valid in str(e.value)
    with pytest.raises(ConfigError, match="mem"):
        build_config("smoke", "t", ["scheduler.slurm.model.mem=lots"])
    with pytest.raises(ConfigError, match="extra_sbatch"):
        build_config("smoke", "t", ["scheduler.slurm.model.extra_sbatch=[reservation]"])
    cfg = build_config("smoke", "t", ["scheduler=slurm", "scheduler.slurm.model.gpus_per_node=4",
                                      "scheduler.slurm.model.extra_sbatch=[--reservation=x]",
                                      "scheduler.slurm.model.env={A: '1 2'}"])
    assert cfg.scheduler.slurm.model.gpus_per_node == 4
    assert cfg.scheduler.slurm.model.extra_sbatch == ["--reservation=x"]
    assert cfg.scheduler.slurm.model.env == {"A": "1 2"}


@pytest.mark.parametrize("option", ["--wait", "--hold", "--test-only", "-W", "-H"])
def test_options_that_keep_sbatch_from_submitting_at_once_are_refused_by_key(option):
    """``--wait`` kept ``sbatch --parsable`` from answering (60 s, then a job left running),
    ``--hold`` would hold the job for ever, ``--test-only`` submits nothing: refused when the
    config is built, one line naming the key."""
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", ["scheduler=slurm",
                                    f"scheduler.slurm.model.extra_sbatch=[{option}]"])
    message = str(e.value)
    assert message.startswith(f"scheduler.slurm.model.extra_sbatch[0]='{option}'"), message
    assert "\n" not in message


@pytest.mark.parametrize("value, seconds", [
    ("", None), ("0", None), ("UNLIMITED", None), ("infinite", None), ("0:00:00", None),
    ("1", 60), ("90", 5400), ("0:30", 60), ("1:30", 120), ("5:00", 300),
    ("1:00:00", 3600), ("01:02:03", 3780), ("1-0", 86400), ("2-12", 216000),
    ("1-02:30", 95400), ("1-02:30:15", 95460)])
def test_time_limits_read_as_slurm_reads_them(value, seconds):
    """minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (seconds rounded up to the
    minute); 0 and UNLIMITED/INFINITE are no limit."""
    check_slurm_time("time", value)
    assert slurm_time_seconds(value) == seconds


@pytest.mark.parametrize("overrides, key", [
    (["scheduler.slurm.time=1"], "scheduler.slurm.time='1'"),
    (["scheduler.slurm.time=4"], "scheduler.slurm.time='4'"),
    (["scheduler.slurm.time=00:03:59"], "scheduler.slurm.time='00:03:59'"),
    (["scheduler.slurm.model.time=1"], "scheduler.slurm.model.time='1'"),
    (["scheduler.slurm.time=60", "scheduler.slurm.rollout.time=2"],
     "scheduler.slurm.rollout.time='2'"),
    (["scheduler.slurm.time=1", "scheduler.slurm.model.time=60"], "scheduler.slurm.time='1'"),
    (["scheduler.slurm.time=10", "scheduler.slurm.signal_seconds=600"],
     "scheduler.slurm.time='10'"),
])
def test_a_time_limit_within_the_warning_is_refused(overrides, key):
    """time=1 with signal_seconds=120 warned every job at once: each requeued every 15-20 s
    for ever. The limit must be at least 2 x signal_seconds + 60 s (Slurm may signal 60 s
    early), named with signal_seconds in one line."""
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", ["scheduler=slurm", *overrides])
    message = str(e.value)
    assert message.startswith(key) and "scheduler.slurm.signal_seconds=" in message, message
    assert "requeue=false" in message and "\n" not in message


@pytest.mark.parametrize("overrides", [
    ["scheduler.slurm.time=5"], ["scheduler.slurm.time=00:05:00"],
    ["scheduler.slurm.time=1", "scheduler.slurm.requeue=false"],
    ["scheduler.slurm.time=1", "scheduler.slurm.signal_seconds=0"],
    ["scheduler.slurm.time=2", "scheduler.slurm.signal_seconds=30"],
    ["scheduler.slurm.time=UNLIMITED"], ["scheduler.slurm.time=0"],
    ["scheduler.slurm.controller.time=1"],  # checked with --detach only (below)
    ["scheduler.slurm.time=1", *(f"scheduler.slurm.{k}.time=1-00" for k in
                                 ("master", "model", "generation", "rollout"))],
])
def test_a_time_limit_with_room_before_the_warning_is_taken(overrides):
    build_config("smoke", "t", ["scheduler=slurm", *overrides])


@pytest.mark.parametrize("raw, state", [
    ("PENDING", JobState.PENDING), ("RUNNING", JobState.RUNNING),
    ("COMPLETING", JobState.RUNNING), ("COMPLETED", JobState.COMPLETED),
    ("CANCELLED by 0", JobState.CANCELLED), ("CANCELLED+", JobState.CANCELLED),
    ("FAILED", JobState.FAILED), ("TIMEOUT", JobState.TIMEOUT),
    ("PREEMPTED", JobState.PREEMPTED), ("NODE_FAIL", JobState.NODE_FAIL),
    ("BOOT_FAIL", JobState.NODE_FAIL), ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
    ("REQUEUED", JobState.REQUEUED), ("REQUEUE_HOLD", JobState.REQUEUED),
    ("SOMETHING_NEW", JobState.UNKNOWN), ("", JobState.UNKNOWN)])
def test_state_table(raw, state):
    assert map_state(raw) == state


def test_every_enum_value_is_reachable():
    assert set(STATE_TABLE.values()) | {JobState.UNKNOWN} == set(JobState)


def test_parsers():
    assert parse_sbatch_parsable("1234\n") == "1234"
    assert parse_sbatch_parsable("77;cluster2") == "77"
    with pytest.raises(SchedulerError):
        parse_sbatch_parsable("sbatch: error: oops")
    info = parse_scontrol_job("JobId=12 JobName=a:b JobState=PENDING Reason=BeginTime "
                              "Restarts=1 ExitCode=0:0")
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1" and info["JobName"] == "a:b"


def test_golden_single_worker_job():
    """A recovery restarts rollout/3 alone: one task, based at worker 3, logging to exactly its
    attempt's file, under its own job name."""
    text = render("rollout", 1, full_config(), attempt=2, first=3)
    check_golden("rollout-3.sbatch", text)
    assert "\nexport RLSYS_WORKER_BASE=3\n" in text
    assert "#SBATCH --job-name=\"gsm8k_t1:rollout.3\"\n" in text
    assert "--output='/shared/runs/it'\"'\"'s a \"quoted\" dir/gsm8k/t1/logs/rollout-3.attempt2.log'" \
        in text
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n#SBATCH --ntasks-per-node=1\n" in text


def test_group_task_logs_are_its_log_paths():
    """A recovery's restarted group keeps its own logs (the ``.attemptN`` suffix)."""
    text = render("rollout", 6, full_config(), attempt=2)
    assert "logs/rollout-%t.attempt2.log' --open-mode=append" in text
    assert "\nexport RLSYS_WORKER_BASE=0\n" in text


def test_one_worker_of_a_multi_node_group_takes_one_node():
    text = render("model", 1, full_config(), first=5)
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n" in text
    assert "#SBATCH --gpus-per-node=8\n" in text and "RLSYS_WORKER_BASE=5" in text


def test_workers_past_zero_in_one_job_are_refused():
    with pytest.raises(ConfigError, match=r"workers 2\.\.4") as e:
        render("rollout", 3, full_config(), first=2)
    assert "\n" not in str(e.value)


def test_task_log_is_exact_with_a_percent_in_the_path():
    paths = TrialPaths("/runs/100%/t1")
    one = GroupSpec("rollout", 1, ("w",), {}, (paths.worker_log("rollout", 3, 1),), first=3)
    assert task_log(one) == "/runs/100%%/t1/logs/rollout-3.attempt1.log"
    group = GroupSpec("rollout", 2, ("w",), {}, tuple(paths.worker_log("rollout", i)
                                                        for i in range(2)))
    assert task_log(group) == "/runs/100%%/t1/logs/rollout-%t.log"
    odd = GroupSpec("rollout", 2, ("w",), {}, ("/l/a-0.log", "/l/b-1.log"))
    with pytest.raises(ConfigError, match="pattern"):
        task_log(odd)


def test_plan_keeps_the_group_script():
    """A single worker's job has its own script beside its group's."""
    sched = SlurmScheduler(full_config(), "gsm8k", "t1", "/trial", "/work")
    paths = TrialPaths("/trial")
    group = sched.plan(group_spec("rollout", 6, paths, "python"))
    one = sched.plan(group_spec("rollout", 1, paths, "python", attempt=1, first=3))
    assert group.script_path == "/trial/jobs/rollout.sbatch"
    assert one.script_path == "/trial/jobs/rollout-3.sbatch"


def test_golden_hetjob():
    """Every group as one heterogeneous job: each component keeps its group's resources,
    environment, setup, container and logs; odd paths stay quoted."""
    from scheduler.slurm_render import render_hetjob_script

    paths = TrialPaths(f"{ODD}/gsm8k/t1")
    groups = [group_spec(k, n, paths, "/opt/py env/bin/python")
              for k, n in (("model", 16), ("rollout", 6), ("master", 1))]
    text = render_hetjob_script(exp="gsm8k", trial="t1", groups=groups, slurm=full_config(),
                                workdir="/home/a b/project", umask=0o077,
                                gpus_per_worker={"model": 1})
    check_golden("hetjob.sbatch", text)
    assert text.count("#SBATCH hetjob\n") == 2 and "--het-group=2" in text
    with pytest.raises(ConfigError, match="two or more whole groups"):
        render_hetjob_script(exp="gsm8k", trial="t1", groups=groups[:1], slurm=full_config(),
                             workdir="/w", umask=0o077, gpus_per_worker={})


def test_a_controller_that_requeues_itself_may_be_requeued():
    """Only a controller that checkpoints and requeues itself (a training trial with requeues
    on) is warned before its time limit, and may be requeued."""
    text = render_controller_script(
        exp="e", trial="t", slurm=SlurmConfig(signal_seconds=90), argv=["python"], env={},
        logs_dir="/r/e/t/logs", workdir="/w", umask=0o077, requeue=True)
    assert "#SBATCH --signal=B:USR2@90\n#SBATCH --requeue\n" in text
    assert "\nexec python\n" in text  # the batch shell is the controller: B: signals it


def test_a_detached_controller_that_requeues_itself_needs_room_before_its_warning(tmp_path):
    """A controller that requeues itself at the warning, with a limit within it, would requeue
    over and over: refused at --detach, in one line naming its key; one that only stops at
    the warning (nothing to resume from) is not."""
    from tests.helpers import run_launch

    root = f"cluster.fileroot={tmp_path}"
    r = run_launch("exp=arith-tiny", "trial=t", root, "scheduler=slurm",
                   "scheduler.slurm.controller.time=2", "--detach")
    assert r.returncode == 2 and r.stderr.startswith(
        "error: scheduler.slurm.controller.time='2' (120 s) is too short for "
        "scheduler.slurm.signal_seconds=120: SIGUSR2 would stop the controller"), r.stderr
    assert len(r.stderr.splitlines()) == 1 and not os.path.exists(tmp_path / "arith-tiny")
    r = run_launch("exp=smoke", "trial=t", root, "scheduler=slurm",
                   "scheduler.slurm.controller.time=2", "--detach", "--dry-run")
    assert r.returncode == 0, r.stderr  # (--dry-run plans the controller's job too)
