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
    ("rollout.count=-1", ["rollout.count", "valid: 0 to 100000 workers"]),
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
    # a type refused said "Value '2.5' of type 'str' could not be converted to Integer"
    ("rl.batch_size=2.5", "bad value for rl.batch_size='2.5': expected an integer"),
    ("rl.total_steps=1e3", "bad value for rl.total_steps='1e3': expected an integer (1e3 is a "
                           "float: write 1000)"),
    ("rl.total_steps=", "bad value for rl.total_steps='': expected an integer, got an empty "
                        "value"),
    ("rl.actor.lr=abc", "bad value for rl.actor.lr='abc': expected a number"),
    ("scheduler.local.spares=maybe", "bad value for scheduler.local.spares='maybe': expected "
                                     "true or false"),
    # omegaconf takes any integer for a boolean (2 and -1 were true)
    ("rl.dynamic_sampling=2", "bad value for rl.dynamic_sampling='2': expected true or false"),
    ("rl.group_std_norm=-1", "bad value for rl.group_std_norm='-1': expected true or false"),
    # a nested value in a map of strings passed the update and failed later, in a traceback
    ("rl.task.options={a: [1, 2]}", "bad value for rl.task.options='{a: [1, 2]}': [1, 2] is "
                                    "not a str; valid: a {map} of str values"),
    ("rl.task.options={a: {b: 1}}", "bad value for rl.task.options='{a: {b: 1}}': {'b': 1} "
                                    "is not a str"),
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


def _float_keys(cfg, path=""):
    """Dotted keys of every float-typed field of ``cfg`` (``Optional[float]`` included)."""
    import dataclasses

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_keys(value, f"{path}{f.name}.")
        elif "float" in str(f.type):
            yield f"{path}{f.name}"


@pytest.mark.parametrize("exp, key", [
    ("smoke", "controller.heartbeat_ttl"), ("smoke", "controller.stall_timeout"),
    ("smoke", "controller.orphan_timeout"), ("smoke", "controller.timeout"),
    ("arith-tiny", "rl.lease_timeout"), ("arith-tiny", "rl.call_timeout"),
    ("arith-tiny", "rl.loss.clip_eps"), ("arith-tiny", "rl.loss.kl_coef"),
    ("arith-tiny", "rl.actor.lr"), ("arith-tiny", "recover.backoff"),
])
@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_non_finite_floats_are_refused(exp, key, raw):
    """Found by a user: NaN passed every ``x <= 0`` check (comparisons with NaN are false), and
    so did inf: ``heartbeat_ttl=nan`` failed later with "no refresh within nans", ``=inf`` made
    every worker's keep-alive thread raise OverflowError, ``rl.actor.lr=nan`` went through
    three recoveries. Every float key must be finite, refused in one line naming it."""
    with pytest.raises(ConfigError) as e:
        build_config(exp, "t", [f"{key}={raw}"])
    assert str(e.value) == f"{key}={raw}: must be a finite number", str(e.value)


def test_every_float_key_of_every_experiment_refuses_nan():
    """The check is generic (the typed config), not a list of keys: a float key added later is
    covered too. ``null`` stays valid where a float key is optional."""
    from experiments.catalog import all_experiments

    for name, experiment in all_experiments().items():
        for key in _float_keys(experiment.make_config()):
            with pytest.raises(ConfigError, match=rf"^{key}=nan: must be a finite number$"):
                build_config(name, "t", [f"{key}=nan"])
    cfg = build_config("arith-tiny", "t", ["rl.vllm.kv_cache_gib=null", "rl.actor.lr=2e-5"])
    assert cfg.rl.vllm.kv_cache_gib is None and cfg.rl.actor.lr == 2e-5


def test_every_float_key_of_every_experiment_refuses_a_huge_value():
    """Found by an audit: ``controller.heartbeat_ttl=1e300`` passed (only a few timeouts had an
    upper bound) and every process's keep-alive thread died of OverflowError; the same generic
    check now bounds every float key at 1e9 (as seconds, 31 years)."""
    from experiments.catalog import all_experiments

    for name, experiment in all_experiments().items():
        for key in _float_keys(experiment.make_config()):
            for raw in ("1e300", "-2e9"):
                with pytest.raises(ConfigError, match=rf"^{key}={raw}: must be a finite number "
                                                      r"of magnitude at most 1e\+09( |$)"):
                    build_config(name, "t", [f"{key}={raw}"])
    assert build_config("smoke", "t", ["controller.stall_timeout=1e9"]).controller \
        .stall_timeout == 1e9
    # the years only for a time in seconds (a learning rate was "as seconds: 31 years")
    with pytest.raises(ConfigError, match=r"^rl.actor.lr=1e10: must be a finite number of "
                                          r"magnitude at most 1e\+09$"):
        build_config("arith-tiny", "t", ["rl.actor.lr=1e10"])
    with pytest.raises(ConfigError, match=r"^rl.call_timeout=1e10: .* \(as seconds: 31 years\)$"):
        build_config("arith-tiny", "t", ["rl.call_timeout=1e10"])
    for key in ("rl.vllm.kv_cache_gib", "rl.save_overhead"):  # (their docs mention seconds)
        with pytest.raises(ConfigError, match=r"at most 1e\+09$"):
            build_config("arith-tiny", "t", [f"{key}=1e10"])


@pytest.mark.parametrize("key", ["model.count", "generation.count", "rollout.count"])
def test_a_worker_count_past_any_cluster_is_refused(key):
    """``model.count=99999999999999999999999`` passed, and even ``--dry-run`` never ended
    (planning each worker: 2 million took 27 s and 2.5 GB)."""
    for raw in ("99999999999999999999999", "100001"):
        with pytest.raises(ConfigError, match=rf"^{key}={raw} is not valid; valid: 0 to 100000 "
                                              "workers$"):
            build_config("smoke", "t", [f"{key}={raw}"])


def test_non_finite_floats_of_a_base_config_are_refused():
    """A base that did not come from the command line (``mode=eval`` rebuilds on the trial's
    saved config.yaml) passes the same check."""
    from experiments.catalog import get_experiment
    from system.launcher.overrides import apply_overrides

    base = get_experiment("smoke").make_config()
    base.exp, base.trial = "smoke", "t"
    base.controller.heartbeat_ttl = float("inf")
    with pytest.raises(ConfigError, match=r"^controller.heartbeat_ttl=inf: must be a finite"):
        apply_overrides(base, [])
    assert apply_overrides(base, ["controller.heartbeat_ttl=3"]).controller.heartbeat_ttl == 3


@pytest.mark.parametrize("argv, words", [
    (["trial=a", "trial=b"], ["trial", "trial=a", "trial=b"]),
    (["exp=arith-tiny", "trial=a"], ["exp", "exp=smoke", "exp=arith-tiny"]),
])
def test_cli_refuses_a_key_given_twice(argv, words):
    """Found by a user: ``trial=a trial=b`` ran trial b, silently."""
    with pytest.raises(ConfigError) as e:
        parse_cli(["exp=smoke", *argv])
    for w in words:
        assert w in str(e.value), str(e.value)
    assert parse_cli(["exp=smoke", "trial=a", "trial=a"]).trial == "a"  # the same twice: ok


@pytest.mark.parametrize("overrides, words", [
    (["rl.actor.lr=1e-5", "rl.actor.lr=2e-5"], ["rl.actor.lr=1e-5", "rl.actor.lr=2e-5"]),
    (["recover=off", "recover.type=auto"], ["recover.type", "recover=off", "recover.type=auto"]),
    (["rl.actor.lr=1e-5", "rl.actor.lr=0.00001"], ["rl.actor.lr=1e-5", "rl.actor.lr=0.00001"]),
])
def test_overrides_refuse_a_key_given_twice(overrides, words):
    """Found by a user: the last of two values of a key won, silently (a section's shorthand,
    ``recover=off``, is the same key as ``recover.type``)."""
    with pytest.raises(ConfigError) as e:
        build_config("arith-tiny", "t", overrides)
    assert "twice" in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)
    cfg = build_config("arith-tiny", "t", ["rl.actor.lr=1e-5", "rl.actor.lr=1e-5"])
    assert cfg.rl.actor.lr == 1e-5  # the same value twice is no conflict
