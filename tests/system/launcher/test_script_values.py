"""Overrides that would reach a job script: a control character in any of them, or a name
with a trailing newline, is one error that names the dotted key and what is valid there."""
from __future__ import annotations

import json
import os
import re

import pytest

from system.bootstrap import Bootstrap
from system.errors import ConfigError
from system.launch import build_config
from system.launcher import run_worker
from system.launcher.config import ExperimentConfig

SLURM_TEXT_KEYS = [
    "scheduler.slurm.partition", "scheduler.slurm.account", "scheduler.slurm.qos",
    "scheduler.slurm.python", "scheduler.slurm.workdir",
    *(f"scheduler.slurm.{g}.{k}" for g in ("model", "controller")
      for k in ("partition", "account", "qos", "constraint", "nodelist", "exclude",
                "container_image", "container_mounts", "apptainer_image", "apptainer_args")),
    "cluster.fileroot", "cluster.interface"]


@pytest.mark.parametrize("key", SLURM_TEXT_KEYS)
@pytest.mark.parametrize("bad", ["x\ntouch /tmp/pwned", "x\r", "x\x1b[2J", "x\x00"])
def test_a_control_character_in_a_scripted_value_names_its_key(key, bad):
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", ["scheduler=slurm", f"{key}={bad}"])
    message = str(e.value)
    assert message.startswith(f"{key}={bad!r} contains the control character"), message
    assert "valid: one line of printable characters" in message
    assert "\n" not in message


@pytest.mark.parametrize("override, key", [
    ('scheduler.slurm.model.setup=["module load cuda", "echo a\\ntouch /tmp/pwned"]',
     "scheduler.slurm.model.setup[1]"),
    ('scheduler.slurm.model.extra_sbatch=["--reservation=rl\\n--output=/tmp/x"]',
     "scheduler.slurm.model.extra_sbatch[0]"),
    ('scheduler.slurm.rollout.env={A: "1", B: "x\\ny"}', "scheduler.slurm.rollout.env['B']"),
])
def test_a_control_character_in_a_list_or_map_entry_names_it(override, key):
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", [override])
    assert str(e.value).startswith(f"{key}="), str(e.value)
    assert "control character '\\n'" in str(e.value)


@pytest.mark.parametrize("override, words", [
    ("scheduler.slurm.model.mem=64G\n", ["scheduler.slurm.model.mem", "control character"]),
    ("scheduler.slurm.model.mem=64G;x", ["scheduler.slurm.model.mem", "e.g. 64G"]),
    ("scheduler.slurm.time=04:00:00\n", ["scheduler.slurm.time", "control character"]),
    ("scheduler.slurm.model.time=1 day", ["scheduler.slurm.model.time", "[D-]HH:MM:SS"]),
    ("scheduler.slurm.model.env={'A;B': x}", ["scheduler.slurm.model.env", "valid variable"]),
    ('scheduler.slurm.model.env={"A\\n": x}', ["scheduler.slurm.model.env", "valid variable"]),
    ('scheduler.slurm.rollout.apptainer_args=--bind "/a', ["apptainer_args", "shell words"]),
    ("scheduler.slurm.model.extra_sbatch=[--output=/home/other/x]",
     ["scheduler.slurm.model.extra_sbatch[0]", "--output is not valid"]),
    ("scheduler.slurm.partition=hetjob", ["scheduler.slurm.partition", "'hetjob'"]),
])
def test_bad_slurm_values_name_the_key_and_what_is_valid(override, words):
    with pytest.raises(ConfigError) as e:
        build_config("smoke", "t", [override])
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("trial", ["t1\n", "t1\r", "t1\n; touch /tmp/pwned", "t 1", "$(x)",
                                   "-t1", ".t1", "t1/..", "t1\u2028"])
def test_trial_names_are_matched_whole(trial):
    """``$`` in a pattern matches before a final newline: ``trial=$'t1\\n'`` used to pass."""
    with pytest.raises(ConfigError, match=re.escape(f"trial={trial!r} is not a valid name")):
        build_config("smoke", trial, [])


@pytest.mark.parametrize("trial", ["a${smoke.crash}", "t${HOME}"])
def test_a_trial_name_is_checked_before_the_config_parser_sees_it(trial):
    """Found by tests/fuzzing: OmegaConf resolved ``${...}`` in the trial name before it was
    checked, so ``trial=a${smoke.crash}`` ran as trial ``a`` (and ``${HOME}``'s error named no
    key)."""
    with pytest.raises(ConfigError, match=re.escape(f"trial={trial!r} is not a valid name")):
        build_config("smoke", trial, [])


def test_experiment_names_are_matched_whole():
    with pytest.raises(ConfigError, match="unknown experiment"):
        build_config("smoke\n", "t1", [])
    with pytest.raises(ConfigError, match=re.escape("exp='smoke\\n' is not a valid name")):
        ExperimentConfig(exp="smoke\n", trial="t1")
    assert build_config("smoke", "t1.v2-b_3", []).trial == "t1.v2-b_3"


@pytest.mark.parametrize("fileroot", ["/runs\\x", "/runs/50%5t"])
def test_a_fileroot_slurm_cannot_write_logs_under_is_refused_under_slurm(fileroot):
    with pytest.raises(ConfigError, match=re.escape(f"cluster.fileroot={fileroot!r}")):
        build_config("smoke", "t", ["scheduler=slurm", f"cluster.fileroot={fileroot}"])
    assert build_config("smoke", "t", [f"cluster.fileroot={fileroot}"]).cluster.fileroot \
        == fileroot  # the local scheduler writes logs itself
    assert build_config("smoke", "t", ["scheduler=slurm", "cluster.fileroot=/r/100%"])


def _bootstrap(tmp_path, experiment: str) -> str:
    d = str(tmp_path)
    Bootstrap(exp="smoke", trial="t", experiment=experiment, trial_dir=d, interface="",
              scheduler="local", name_resolve={}, name_resolve_root=d, rpc={},
              heartbeat_ttl=5.0).write(os.path.join(d, "bootstrap.json"))
    return d


@pytest.mark.parametrize("experiment", ["os:system", "subprocess:run", "smoke\n",
                                        "experiments.smoke:SMOKE"])
def test_a_worker_takes_its_role_from_the_registry_only(tmp_path, experiment):
    """The bootstrap names a registered experiment; anything else (a ``module:function``
    included) stops the worker before it imports or calls anything."""
    d = _bootstrap(tmp_path, experiment)
    with pytest.raises(ConfigError, match="unknown experiment"):
        run_worker.main(["--trial-dir", d, "--kind", "rollout", "--index", "0"])
    with open(os.path.join(d, "bootstrap.json")) as f:
        assert json.load(f)["experiment"] == experiment


def test_roles_are_looked_up_by_kind_only():
    from experiments.catalog import get_experiment

    roles = get_experiment("smoke").roles
    assert callable(roles.of("rollout"))
    for kind in ("__class__", "of", "__init__", "os:system"):
        with pytest.raises(ConfigError, match="valid: \\['master', 'model', 'generation'"):
            roles.of(kind)


def test_no_package_imports_code_by_name():
    """Nothing resolves a module or function from a string (a config value, a message): roles,
    tasks and engines come from explicit tables."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    bad = re.compile(r"import_module|__import__|importlib\.(util\.)?(spec_from|module_from)"
                     r"|(?<![.\w])(eval|exec)\(|pydoc\.locate")
    found = []
    for package in ("system", "scheduler", "workers", "experiments", "slurm"):
        for dirpath, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        found += [f"{dirpath}/{name}: {m.group(0)}"
                                  for m in bad.finditer(f.read())]
    assert found == []


@pytest.mark.parametrize("trial, override, key", [
    ("my-hetjob", "scheduler=slurm", "trial"),
    ("t1", "cluster.fileroot=/data/PackJob-runs", "cluster.fileroot"),
])
def test_a_trial_or_file_root_that_sbatch_would_blank_is_refused_naming_it(trial, override,
                                                                          key):
    """Found by tests/fuzzing: both reach ``#SBATCH`` lines (job names, log paths), where sbatch
    removes 'hetjob' and 'packjob'; rendering refused them with an error that named no key."""
    with pytest.raises(ConfigError) as e:
        build_config("smoke", trial, ["scheduler=slurm", override])
    assert str(e.value).startswith(f"{key}=") and "hetjob" in str(e.value), str(e.value)
    local = [] if override == "scheduler=slurm" else [override]
    build_config("smoke", trial, local)  # the local scheduler writes no #SBATCH line
