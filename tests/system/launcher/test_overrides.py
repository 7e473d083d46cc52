"""Config composition, validation and override parsing."""
from __future__ import annotations

import pytest

from experiments.catalog import get_experiment
from scheduler.config import SchedulerKind
from system.structs import field_docs
from system.errors import ConfigError
from system.launch import build_config, help_text
from system.name_resolve import NameResolveBackend
from system.launcher.overrides import parse_cli
from tests.helpers import run_launch


def test_defaults_and_overrides():
    cfg = build_config("smoke", "t", ["rollout.count=8", "smoke.crash=rollout:7:1.5",
                                      "controller.heartbeat_ttl=2", "name_resolve=redis",
                                      "cluster.fileroot=/tmp/x y"])
    assert cfg.rollout.count == 8 and cfg.controller.heartbeat_ttl == 2.0
    assert cfg.name_resolve.type == NameResolveBackend.REDIS
    assert cfg.scheduler.type == SchedulerKind.LOCAL
    assert cfg.cluster.fileroot == "/tmp/x y"
    assert cfg.smoke.crash_spec() == ("rollout", 7, 1.5, "kill")
    assert cfg.worker_counts() == {"master": 1, "model": 2, "generation": 2, "rollout": 8}


@pytest.mark.parametrize("override, words", [
    ("rollout.cout=3", ["rollout.cout", "count", "push_timeout"]),
    ("nosuch=1", ["nosuch", "rollout", "smoke", "scheduler"]),
    ("rollout.count=many", ["rollout.count", "many"]),
    ("rollout.count=-1", ["rollout.count", ">= 0"]),
    ("scheduler=pbs", ["scheduler.type", "local", "slurm"]),
    ("rollout=3", ["rollout", "count"]),
    ("rollout.count.x=3", ["rollout.count", "value"]),
    ("smoke.crash=rollout:9:1", ["only 4 rollout"]),
    ("smoke.crash=whatever", ["KIND:INDEX:SECONDS"]),
    ("controller.heartbeat_ttl=0", ["controller.heartbeat_ttl", "> 0"]),
])
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", [override])
    for w in words:
        assert w in str(e.value), str(e.value)


def test_cli_requires_exp_and_trial():
    with pytest.raises(ConfigError, match="trial"):
        parse_cli(["exp=smoke"])
    with pytest.raises(ConfigError, match="exp=... and trial"):
        parse_cli([])
    with pytest.raises(ConfigError, match="--dry-run"):
        parse_cli(["exp=smoke", "trial=t", "--dryrun"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_cli(["exp=smoke", "trial=t", "rollout.count"])


def test_unknown_experiment_lists_valid():
    with pytest.raises(ConfigError, match="smoke"):
        get_experiment("nope")


def test_bad_trial_name():
    with pytest.raises(ConfigError, match="trial"):
        build_config("smoke", "a/b", [])


def test_field_docs_and_help():
    assert "rollout workers" in field_docs(type(build_config("smoke", "t", [])))["rollout"].lower()
    text = help_text("smoke")
    for w in ("smoke", "rollout", "count", "How many rollout workers", "crash"):
        assert w in text


@pytest.mark.parametrize("args, code, words", [
    (["exp=smoke", "trial=t", "rollout.cont=2"], 2, ["rollout.cont", "count"]),
    (["exp=smoke"], 2, ["trial"]),
    (["exp=nosuch", "trial=t"], 2, ["nosuch", "smoke"]),
    (["exp=smoke", "trial=t", "model.count=two"], 2, ["model.count", "two"]),
])
def test_cli_errors_are_one_clear_line(args, code, words, fileroot):
    r = run_launch(*args, f"cluster.fileroot={fileroot}")
    assert r.returncode == code
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ")
    for w in words:
        assert w in r.stderr


def test_cli_help_and_dry_run(fileroot):
    r = run_launch("--help")
    assert r.returncode == 0 and "experiments:" in r.stdout and "smoke" in r.stdout
    r = run_launch("exp=smoke", "trial=dry", f"cluster.fileroot={fileroot}", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "system.launcher.run_worker" in r.stdout and "rollout/3" in r.stdout and "nothing submitted" in r.stderr
