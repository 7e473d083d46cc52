"""Config composition, validation and override parsing (``key=value`` overrides, the CLI)."""
from __future__ import annotations

import pytest

from scheduler.config import SchedulerKind
from system.errors import ConfigError
from system.launch import build_config
from system.name_resolve import NameResolveBackend
from system.launcher.overrides import parse_cli


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
