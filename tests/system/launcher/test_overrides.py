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


@pytest.mark.parametrize("override, message", [
    ("rl.mode=fast", "rl.mode='fast' is not one of async, sync"),
    ("rl.weight_sync.mode=x", "rl.weight_sync.mode='x' is not one of"),
    ("rl.loss.clip_eps=-1", "rl.loss.clip_eps must be > 0"),
    ("rl.actor.lr=0", "rl.actor.lr must be > 0"),
    ("rl.vllm.interrupt=x", "rl.vllm.interrupt='x' is not one of cut, finish"),
    ("rl.agent.kind=x", "rl.agent.kind='x' is not one of"),
    ("rl.task.ops=/", "rl.task.ops='/' must be made of"),
    ("rpc.stream_hwm=0", "rpc.stream_hwm must be >= 1"),
    ("recover=x", "bad value for recover.type='x': valid values: ['auto', 'resume', 'off']"),
    ("recover.retries=-1", "recover.retries and backoff must be >= 0"),
])
def test_sections_errors_get_their_mount_point(override, message):
    """Sections name only their own fields; the override machinery adds the dotted path of the
    section that raised."""
    with pytest.raises(ConfigError) as e:
        build_config("arith-tiny", "t", [override])
    assert str(e.value).startswith(message), str(e.value)


def test_cli_requires_exp_and_trial():
    with pytest.raises(ConfigError, match="trial"):
        parse_cli(["exp=smoke"])
    with pytest.raises(ConfigError, match="exp=... and trial"):
        parse_cli([])
    with pytest.raises(ConfigError, match="--dry-run"):
        parse_cli(["exp=smoke", "trial=t", "--dryrun"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_cli(["exp=smoke", "trial=t", "rollout.count"])


@pytest.mark.parametrize("override, key", [
    ("scheduler.slurm.partition=${cluster.fileroot}", "scheduler.slurm.partition"),
    ("scheduler.slurm.model.account=${oc.env:HOME}", "scheduler.slurm.model.account"),
    ("scheduler.slurm.model.qos=a\\${x}", "scheduler.slurm.model.qos"),
    ("scheduler.slurm.master.mem=${HOME}", "scheduler.slurm.master.mem"),
    ('scheduler.slurm.model.setup=["export P=${HOME}/bin"]', "scheduler.slurm.model.setup"),
    ("scheduler.slurm.rollout.env={A: '${oc.env:RLSYS_REDIS_PASSWORD}'}",
     "scheduler.slurm.rollout.env"),
    ("rollout.count=${generation.count}", "rollout.count"),
    ("scheduler.slurm.controller.exclude=???", "scheduler.slurm.controller.exclude"),
])
def test_override_values_are_literal(override, key):
    """Found by tests/fuzzing: OmegaConf resolved ``${...}`` in an override (another key's value,
    an environment variable: the value written into config.yaml and job scripts was not the one
    given), turned ``\\${x}`` into ``${x}``, and read ``???`` as missing; the errors for an
    unknown interpolation or ``???`` did not name the key. Now each is refused, naming it."""
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", [override])
    assert str(e.value).startswith(f"{key}="), str(e.value)
    assert "valid: a value without '${'" in str(e.value)
    assert build_config("smoke", "t", ["scheduler.slurm.partition=$HOME{a}??"]
                        ).scheduler.slurm.partition == "$HOME{a}??"
