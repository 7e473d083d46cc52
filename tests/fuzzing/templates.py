"""Hostile values in every config string that reaches an sbatch script (every ``str``,
``List[str]`` and ``Dict[str, str]`` field of ``scheduler.slurm`` and of each group, the file
root, the interface and the trial name), given as the launcher's command line gives them.

Each value is either refused with a ``ConfigError`` naming its key (dropped_and_counted), or
the worker script of its group and the controller script (``--detach``; it carries every
override on its command line) pass ``bash -n`` and, run by bash with ``srun``, ``apptainer``
and ``scontrol`` replaced by recorders (as in ``tests/scheduler/test_script_safety.py``), run
nothing of it (no marker file) and deliver it verbatim: the config holds it as given, and it
reaches sbatch's directive parser, srun's arguments, the environment, the working directory
or the controller's command line unchanged (accepted). Any other exception: crashed; a
marker, or a value that arrives changed: wrongly_accepted; a ``ConfigError`` that does not
name the key: miscounted. ``setup`` lines are shell the operator writes on purpose: they must
arrive as one line of the script, which is then not run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shlex
import shutil
import subprocess
from typing import Any

from scheduler.registry import make_scheduler
from scheduler.slurm import SlurmScheduler
from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from system.errors import ConfigError
from system.launch import build_config
from system.launcher.config import ExperimentConfig
from system.launcher.groups import group_specs
from system.launcher.submit import controller_request
from system.paths import TrialPaths
from tests.fuzzing import Budget, Tally
from tests.scheduler.test_script_safety import RECORDER, sbatch_arguments

GROUPS = ("master", "model", "generation", "rollout", "controller")
SBATCH_KEYS = {"partition", "account", "qos", "constraint", "nodelist", "exclude", "time", "mem"}
"""Fields written as ``#SBATCH --<key>=<value>``."""
TRIAL = "t1"


def script_keys() -> list[str]:
    """Every dotted key whose string value reaches a job script."""
    keys = ["trial", "cluster.fileroot", "cluster.interface"]
    keys += [f"scheduler.slurm.{f.name}" for f in dataclasses.fields(SlurmConfig)
             if f.type == "str"]
    keys += [f"scheduler.slurm.{g}.{f.name}" for g in GROUPS
             for f in dataclasses.fields(SlurmGroupConfig)
             if f.type in ("str", "List[str]", "Dict[str, str]")]
    return keys


def _fragments(mark: str) -> list[str]:
    return [f"$(touch {mark})", f"`touch {mark}`", f"; touch {mark}", f"| touch {mark} #",
            f"&& touch {mark}", f"\ntouch {mark}", f"\r\ntouch {mark}", "\t", "\x00", "\x1b[2J",
            "\x7f", "\x85", "\u2028", "\u2029", "'", '"', "\\", '\\"', "$", "$HOME", "${HOME}",
            "${oc.env:HOME}", "${cluster.fileroot}", "\\${x}", "%", "%j", "%t", "%%", "%5t",
            "%x", "#", " # c", "*", "?", "[a]", "~", "!", "{a,b}", "$'\\x41'", "-", "--", "-x",
            "=", ":", ",", " ", "", "???", "null", "None", "hetjob", "é", "日本", "\u200b",
            "\ufeff", "a b", "--output=/tmp/x", "<x", ">x", "2>&1", "&", "..", "/"]


def hostile(rng: random.Random, mark: str) -> str:
    """1 to 3 hostile fragments, sometimes with plain text between them."""
    parts = rng.choices(_fragments(mark), k=rng.randint(1, 3))
    if rng.random() < 0.3:
        parts.insert(rng.randint(0, len(parts)), "".join(
            chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 12))))
    return "".join(parts)


@dataclasses.dataclass
class Case:
    key: str
    value: Any
    """What the key is set to: a string, a list of strings or a map."""
    overrides: list[str]
    """The whole command line after ``exp=`` (``trial=...`` first)."""


def make_case(rng: random.Random, key: str, mark: str) -> Case:
    field = key.rsplit(".", 1)[-1]
    text = hostile(rng, mark)
    if field in ("setup", "extra_sbatch"):
        value: Any = [text] + ([hostile(rng, mark)] if rng.random() < 0.3 else [])
        raw = json.dumps(value)
    elif field == "env":
        value = ({"FUZZ_V": text} if rng.random() < 0.7 else {text: "x"})
        raw = json.dumps(value)
    elif field == "workdir":  # a directory the run can create and enter: relative, no '..'
        value = raw = "/".join(p for p in text.split("/") if p not in ("", "..")) or "w"
    else:
        value = raw = text
    trial = value if key == "trial" else TRIAL
    overrides = [f"trial={trial}", "scheduler=slurm", "scheduler.slurm.python=record"]
    group = key.split(".")[2] if key.count(".") == 3 else ""
    if field == "container_mounts":
        overrides.append(f"scheduler.slurm.{group}.container_image=img")
    if field == "apptainer_args":
        overrides.append(f"scheduler.slurm.{group}.apptainer_image=/img.sif")
    if key != "trial":
        overrides.append(f"{key}={raw}")
    return Case(key, value, overrides)


@dataclasses.dataclass
class Sandbox:
    """A directory to run scripts in, with recorders for srun, apptainer and scontrol."""

    root: str

    @property
    def mark(self) -> str:
        return os.path.join(self.root, "pwned")

    @property
    def bin(self) -> str:
        return os.path.join(self.root, "bin")

    @property
    def cwd(self) -> str:
        return os.path.join(self.root, "cwd")

    def setup(self) -> "Sandbox":
        os.makedirs(self.bin, exist_ok=True)
        os.makedirs(self.cwd, exist_ok=True)
        for name in ("srun", "apptainer", "scontrol", "record"):
            path = os.path.join(self.bin, name)
            with open(path, "w") as f:
                f.write(RECORDER)
            os.chmod(path, 0o700)
        return self

    def run(self, text: str) -> dict[str, list[str]] | str:
        """``bash -n``, then bash runs ``text``: what each recorder got, or what went wrong."""
        check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        if check.returncode:
            return f"bash -n: {check.stderr.strip()[:200]}"
        record = os.path.join(self.root, "record")
        shutil.rmtree(record, ignore_errors=True)
        os.makedirs(record)
        path = os.path.join(self.root, "job.sbatch")
        with open(path, "w") as f:
            f.write(text)
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "RECORD": record, "SLURM_JOB_ID": "4242",
               "HOME": self.root, "LANG": "C.UTF-8"}
        subprocess.run(["bash", path], env=env, cwd=self.cwd, capture_output=True, timeout=30)
        out = {}
        for name in os.listdir(record):
            with open(os.path.join(record, name), encoding="utf-8", errors="surrogateescape") as f:
                out[name] = f.read().split("\0")[:-1]
        return out


def _config_value(cfg: ExperimentConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _where(key: str) -> str:
    """The script a key's value shows in: its group's (the controller's own for
    ``scheduler.slurm.controller.*``), the master group's for a global one."""
    parts = key.split(".")
    return parts[2] if len(parts) == 4 else "master"


def render(cfg: ExperimentConfig, case: Case) -> dict[str, str]:
    """The script of the key's group and the controller's, as the launcher writes them."""
    paths = TrialPaths.of(cfg.cluster.fileroot, cfg.exp, cfg.trial)
    sched = make_scheduler(cfg.scheduler, cfg.exp, cfg.trial, paths.root)
    assert isinstance(sched, SlurmScheduler)
    scripts = {"controller": controller_request(cfg, paths, sched,
                                                ["exp=smoke", *case.overrides]).materialize()}
    where = _where(case.key)
    if where != "controller":
        scripts[where] = sched.plan(group_specs(cfg, paths, sched.python)[where]).materialize()
    return scripts


def _srun_args(case: Case, root: str, args: list[str]) -> list[str]:
    """What is wrong with the srun arguments of the key's group (pyxis, apptainer, python,
    trial directory)."""
    field, v = case.key.rsplit(".", 1)[-1], case.value

    def after(word: str, skip: int, n: int = 1) -> list[str]:
        return args[args.index(word) + skip:][:n] if word in args else []

    problems = []
    if field == "container_image" and v and f"--container-image={v}" not in args:
        problems.append("--container-image")
    if field == "container_mounts" and v and f"--container-mounts={v}" not in args:
        problems.append("--container-mounts")
    if field == "apptainer_image" and v and after("exec", 2) != [v]:
        problems.append("apptainer image")
    if field == "apptainer_args":
        words = shlex.split(v)
        if after("exec", 1, len(words) + 1) != [*words, "/img.sif"]:
            problems.append("apptainer arguments")
    if field == "python" and v and after("system.launcher.run_worker", -2) != [v]:
        problems.append("python")
    if (field == "fileroot" or case.key == "trial") and after("--trial-dir", 1) != [root]:
        problems.append("--trial-dir")
    return [f"srun {p}: {args}" for p in problems]


def _delivered(case: Case, cfg: ExperimentConfig, scripts: dict[str, str],
               records: dict[str, dict[str, list[str]]], sandbox: Sandbox) -> list[str]:
    """Where the value did not arrive as given (empty: it did everywhere)."""
    root = os.path.join(sandbox.cwd, cfg.cluster.fileroot, cfg.exp, cfg.trial)  # as the
    # launcher resolves it from where it runs
    field, v, where = case.key.rsplit(".", 1)[-1], case.value, _where(case.key)
    problems = [] if _config_value(cfg, case.key) == v else [
        f"the config holds {_config_value(cfg, case.key)!r}"]
    targets = [where] if where != "master" or case.key.count(".") == 3 else ["master",
                                                                              "controller"]
    for name in targets:
        text, rec = scripts[name], records.get(name, {})
        directives = sbatch_arguments(text)
        wanted = ([f"--{field}={v}"] if field in SBATCH_KEYS and v else
                  list(v) if field == "extra_sbatch" else
                  [f"--job-name=smoke_{v}:{name}"] if case.key == "trial" else [])
        problems += [f"#SBATCH {w!r} missing" for w in wanted if w not in directives]
        if field == "setup":
            problems += [f"setup line {s!r} missing" for s in v if s not in text.splitlines()]
        env = rec.get("record.env" if name == "controller" else "srun.env", [])
        if field == "env":
            problems += [f"env {k}={x!r} missing" for k, x in v.items() if f"{k}={x}" not in env]
        if name != "controller" and "srun.args" in rec:
            problems += _srun_args(case, os.path.abspath(root), rec["srun.args"])
        if field == "workdir" and name != "controller":
            pwd = dict(e.split("=", 1) for e in env if "=" in e).get("PWD", "")
            if os.path.realpath(pwd) != os.path.realpath(os.path.join(sandbox.cwd, v)):
                problems.append(f"the workers start in {pwd!r}")
    return problems


def _controller_argv(case: Case, records: dict[str, dict[str, list[str]]]) -> list[str]:
    got = records.get("controller", {}).get("record.args")
    want = ["-m", "system.launch", "exp=smoke", *case.overrides, "controller.progress=false"]
    return [] if got == want else [f"the controller ran {got!r}"]


def _judge_refusal(tally: Tally, case: Case, e: ConfigError) -> None:
    named = f"{case.key}=" if case.key == "trial" else case.key
    if named in str(e):
        tally.dropped_and_counted += 1
    else:
        tally.miscounted += 1
        tally.note(f"{case.key}={case.value!r}: refused without naming the key: {e}")


def run_case(case: Case, sandbox: Sandbox, tally: Tally) -> None:
    """Configure, render, run and judge one hostile value (see the module's docstring)."""
    tally.tried += 1
    here = os.getcwd()
    try:
        os.chdir(sandbox.cwd)  # where the launcher runs (a relative workdir is taken from it)
        cfg = build_config("smoke", case.overrides[0][len("trial="):], case.overrides[1:])
        scripts = render(cfg, case)
    except ConfigError as e:
        _judge_refusal(tally, case, e)
        return
    except Exception as e:
        tally.crashed += 1
        tally.note(f"{case.key}={case.value!r}: {type(e).__name__}: {e}")
        return
    finally:
        os.chdir(here)
    field = case.key.rsplit(".", 1)[-1]
    if field == "workdir":
        os.makedirs(os.path.join(sandbox.cwd, case.value), exist_ok=True)
    records, problems = {}, []
    for name, text in scripts.items():
        if field == "setup" and name == _where(case.key):
            continue  # the operator's own shell: not run
        got = sandbox.run(text)
        if isinstance(got, str):
            problems.append(f"{name}: {got}")
        else:
            records[name] = got
    if field != "python" and not (field == "setup" and _where(case.key) == "controller"):
        problems += _controller_argv(case, records)
    try:
        problems += _delivered(case, cfg, scripts, records, sandbox)
    except AssertionError as e:  # sbatch_arguments: a directive line sbatch could not parse
        problems.append(f"#SBATCH: {e}")
    if os.path.exists(sandbox.mark):
        os.unlink(sandbox.mark)
        problems.append("a marker file was created")
    if problems:
        tally.wrongly_accepted += 1
        tally.note(f"{case.key}={case.value!r}: {'; '.join(problems)}")
    else:
        tally.accepted += 1


def template_attack(root: str, rng: random.Random, budget: Budget) -> Tally:
    """Hostile values, each into a key drawn from :func:`script_keys`, in a sandbox under
    ``root``."""
    tally, sandbox = Tally("templates"), Sandbox(root).setup()
    keys = script_keys()
    for _ in budget.rounds(tally):
        run_case(make_case(rng, rng.choice(keys), sandbox.mark), sandbox, tally)
    return tally
