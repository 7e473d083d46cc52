"""Hostile values in the Slurm settings and trial paths: refused with an error that names the
key and what is valid, or written so that neither bash nor sbatch's directive parser runs or
reinterprets them.

The rendered scripts pass ``bash -n`` and are then run by bash, with ``srun``, ``apptainer``
and ``scontrol`` on PATH replaced by executables that record their arguments and environment
(like submitit's tests fake ``sbatch``): the values arrive verbatim and nothing they contain runs.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess

import pytest

from scheduler.script_text import FILTERS, sbatch_quote, shell_quote
from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from scheduler.slurm_render import (TEMPLATES, render_controller_script, render_worker_script,
                                    task_log, template_environment)
from system.errors import ConfigError
from system.launcher.groups import group_spec
from system.paths import TrialPaths


def hostile(tmp: str) -> list[str]:
    """Values that run ``touch <tmp>/pwned`` if a shell ever evaluates them."""
    mark = f"{tmp}/pwned"
    return [f"$(touch {mark})", f"`touch {mark}`", f"x; touch {mark}", f"x && touch {mark} #",
            f"a'b\"c \\ $(touch {mark}) # d"]


RECORDER = """#!/bin/bash
printf '%s\\0' "$@" > "$RECORD/$(basename "$0").args"
env -0 > "$RECORD/$(basename "$0").env"
"""


def fake_bin(tmp: str) -> str:
    """A directory of executables that only record how they were called."""
    d = os.path.join(tmp, "bin")
    os.makedirs(d)
    for name in ("srun", "apptainer", "scontrol", "record"):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write(RECORDER)
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return d


def run_script(text: str, tmp: str) -> dict[str, list[str]]:
    """``bash -n`` then bash runs ``text``; returns what each recorder got (args, env)."""
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    record = os.path.join(tmp, "record")
    os.makedirs(record, exist_ok=True)
    path = os.path.join(tmp, "job.sbatch")
    with open(path, "w") as f:
        f.write(text)
    env = {"PATH": f"{fake_bin(tmp)}:/usr/bin:/bin", "RECORD": record, "SLURM_JOB_ID": "4242",
           "HOME": tmp}
    r = subprocess.run(["bash", path], env=env, cwd=tmp, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = {}
    for name in os.listdir(record):
        with open(os.path.join(record, name)) as f:
            out[name] = f.read().split("\0")[:-1]
    return out


def sbatch_arguments(script: str) -> list[str]:
    """The arguments sbatch reads from the ``#SBATCH`` lines of ``script`` (which end at the
    first line that is neither a comment nor blank)."""
    args: list[str] = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            args += directive_words(line[len("#SBATCH"):])
    return args


def directive_words(text: str) -> list[str]:
    """``text`` split the way sbatch's directive parser (``_get_argument`` in Slurm's
    src/sbatch/opt.c) splits it: whitespace separates, '...' and "..." group, a backslash
    takes the next character as it is, an unquoted ``#`` ends the line."""
    words: list[str] = []
    word: str | None = None
    quote, escape = "", False
    for c in text:
        if escape:
            word, escape = (word or "") + c, False
        elif c == "\\":
            escape = True
        elif quote and c == quote:
            quote = ""
        elif quote:
            word = (word or "") + c
        elif c in "\"'":
            quote, word = c, word or ""
        elif c == "#":
            break
        elif c.isspace():
            if word is not None:
                words.append(word)
            word = None
        else:
            word = (word or "") + c
    assert not quote and not escape, f"unterminated {text!r}"
    return words + ([word] if word is not None else [])


def nasty_config(values: list[str], tmp: str) -> SlurmConfig:
    """Every free-text field of the model (pyxis) and rollout (apptainer) groups hostile."""
    v = values
    return SlurmConfig(
        partition=v[0], account=v[1], qos=v[2],
        model=SlurmGroupConfig(constraint=v[3], nodelist=v[4], exclude=v[0],
                               extra_sbatch=[f"--comment={x}" for x in v],
                               env={f"ODD{i}": x for i, x in enumerate(v)},
                               container_image=v[1], container_mounts=f"{v[2]}:/runs"),
        rollout=SlurmGroupConfig(apptainer_image=v[3], apptainer_args=f"--nv {v[0]} {v[2]}"))


@pytest.fixture
def odd(tmp_path) -> tuple[str, list[str], TrialPaths, str, str]:
    """(tmp, hostile values, a trial whose path is hostile and has Slurm patterns in it,
    the python executable and the working directory, both with hostile names)."""
    tmp = str(tmp_path)
    values = hostile(tmp)
    paths = TrialPaths(os.path.join(tmp, f"runs 100% %j %t {values[0]}", "smoke", "t1"))
    workdir = os.path.join(tmp, f"work {values[2]}")
    os.makedirs(workdir)
    return tmp, values, paths, f"/opt/py {values[1]}/python", workdir


def test_hostile_values_reach_srun_verbatim_and_never_run(odd):
    tmp, values, paths, python, workdir = odd
    group = group_spec("model", 2, paths, python)
    text = render_worker_script(exp="smoke", trial="t1", umask=0o077, group=group,
                                slurm=nasty_config(values, tmp), workdir=workdir)
    got = run_script(text, tmp)
    assert not os.path.exists(f"{tmp}/pwned")
    assert got["srun.args"] == ["--wait=0", "--kill-on-bad-exit=0",
                                f"--output={task_log(group)}", "--open-mode=append",
                                f"--container-image={values[1]}",
                                f"--container-mounts={values[2]}:/runs", *group.argv]
    env = dict(e.split("=", 1) for e in got["srun.env"])
    assert [env[f"ODD{i}"] for i in range(len(values))] == values
    assert env["PWD"] == workdir
    assert env["RLSYS_REQUEUE_MARK"] == os.path.join(paths.logs, ".requeue-model-4242")


def test_apptainer_args_are_arguments_not_commands(odd):
    """``apptainer_args`` used to be written as it was: ``$(...)`` or a newline in it ran."""
    tmp, values, paths, python, workdir = odd
    group = group_spec("rollout", 1, paths, python)
    text = render_worker_script(exp="smoke", trial="t1", umask=0o077, group=group,
                                slurm=nasty_config(values, tmp), workdir=workdir)
    got = run_script(text, tmp)
    assert not os.path.exists(f"{tmp}/pwned")
    args = got["srun.args"]
    assert args[4:6] == ["apptainer", "exec"]
    assert args[6:] == ["--nv", "$(touch", f"{tmp}/pwned)", "x;", "touch", f"{tmp}/pwned",
                        values[3], *group.argv]


def test_sbatch_reads_hostile_values_back_exactly(odd):
    tmp, values, paths, python, workdir = odd
    text = render_worker_script(exp="smoke", trial="t1", umask=0o077, group=group_spec("model", 2, paths,
                                                                          python),
                                slurm=nasty_config(values, tmp), workdir=workdir)
    args = sbatch_arguments(text)
    for option, value in [("partition", values[0]), ("account", values[1]),
                          ("qos", values[2]), ("constraint", values[3]),
                          ("nodelist", values[4]), ("exclude", values[0])]:
        assert f"--{option}={value}" in args
    assert [a for a in args if a.startswith("--comment=")] == [f"--comment={v}" for v in values]
    assert f"--output={paths.logs.replace('%', '%%')}/slurm-model-%j.log" in args


def test_the_controller_script_runs_its_argv_verbatim(odd):
    tmp, values, paths, _, workdir = odd
    argv = ["record", "-m", "system.launch", *values, f"cluster.fileroot={values[4]}"]
    text = render_controller_script(exp="smoke", trial="t1", umask=0o077, slurm=nasty_config(values, tmp),
                                    argv=argv, env={"PYTHONUNBUFFERED": "1", "V": values[1]},
                                    logs_dir=paths.logs, workdir=workdir)
    got = run_script(text, tmp)
    assert not os.path.exists(f"{tmp}/pwned")
    assert got["record.args"] == argv[1:]
    assert f"V={values[1]}" in got["record.env"]
    assert f"--partition={values[0]}" in sbatch_arguments(text)


def expand_slurm_pattern(pattern: str, job_id: str, task: int = 0) -> str:
    """The file Slurm writes for an ``--output`` pattern, as its man pages define the
    replacements used here: ``%%`` is one ``%``, ``%j`` the job id, ``%t`` the task rank;
    a ``%`` before any other character stays as it is."""
    return re.sub(r"%([%jt])", lambda m: {"%": "%", "j": job_id, "t": str(task)}[m.group(1)],
                  pattern)


def test_a_percent_in_the_trial_path_gives_the_log_paths_the_controller_reads(tmp_path):
    """``%`` is doubled only inside Slurm's filename patterns, so the job writes exactly the
    paths the controller reads and prints; elsewhere (the requeue mark, cd) it stays one."""
    paths = TrialPaths(os.path.join(str(tmp_path), "100% %j %t %%x", "smoke", "t1"))
    group = group_spec("rollout", 3, paths, "python")
    text = render_worker_script(exp="smoke", trial="t1", umask=0o077, group=group, slurm=SlurmConfig(),
                                workdir=str(tmp_path))
    output = next(a for a in sbatch_arguments(text) if a.startswith("--output="))
    assert expand_slurm_pattern(output[len("--output="):], "77") == \
        os.path.join(paths.logs, "slurm-rollout-77.log")
    assert [expand_slurm_pattern(task_log(group), "77", i) for i in range(3)] == \
        list(group.log_paths)
    assert f"export RLSYS_REQUEUE_MARK={shell_quote(paths.logs + '/.requeue-rollout-')}" in text
    controller = render_controller_script(exp="smoke", trial="t1", umask=0o077, slurm=SlurmConfig(),
                                          argv=["python"], env={}, logs_dir=paths.logs,
                                          workdir=str(tmp_path))
    output = next(a for a in sbatch_arguments(controller) if a.startswith("--output="))
    assert expand_slurm_pattern(output[len("--output="):], "78") == \
        os.path.join(paths.logs, "controller.log")


@pytest.mark.parametrize("root, what", [("a\\b", "a backslash"), ("50%5t", "'%' before a digit")])
def test_log_paths_slurm_would_rewrite_are_refused(tmp_path, root, what):
    """Slurm strips backslashes from ``--output`` and then expands no pattern; srun loses the
    digit of ``%%5t``: no pattern could name the log the controller reads."""
    paths = TrialPaths(os.path.join(str(tmp_path), root, "smoke", "t1"))
    with pytest.raises(ConfigError, match=f"{what}.*cluster.fileroot"):
        render_worker_script(exp="smoke", trial="t1", umask=0o077, group=group_spec("rollout", 2, paths, "p"),
                             slurm=SlurmConfig(), workdir=str(tmp_path))


@pytest.mark.parametrize("line, rendered", [
    ("--reservation=rl", '--reservation="rl"'),
    ("--gres-flags=enforce-binding", '--gres-flags="enforce-binding"'),
    ("--mail-type=END,FAIL", '--mail-type="END,FAIL"'),
    ("--gpus=8", '--gpus="8"'),
    ("--contiguous", "--contiguous"),
    ("--wait-all-nodes=1", '--wait-all-nodes="1"'),
    ("--parsable", "--parsable"),  # (a second one changes nothing: sbatch prints the id)
    ('--comment=a "b" #c $(touch x)', '--comment="a \\"b\\" #c $(touch x)"'),
])
def test_extra_sbatch_lines_are_one_option_with_a_quoted_value(line, rendered):
    text = render_worker_script(
        exp="smoke", trial="t1", group=group_spec("master", 1, TrialPaths("/r/smoke/t1"), "p"),
        slurm=SlurmConfig(master=SlurmGroupConfig(extra_sbatch=[line])), workdir="/w", umask=0o077)
    assert f"\n#SBATCH {rendered}\n" in text
    assert sbatch_arguments(text)[-1] == line


@pytest.mark.parametrize("line, words", [
    ("reservation=rl", ["extra_sbatch[1]", "'--option' or '--option=value'"]),
    ("#SBATCH --reservation=rl", ["without '#SBATCH'"]),
    ("-w node1", ["'--option' or '--option=value'"]),
    ("--reservation=", ["not one sbatch option"]),
    ("--a --b", ["not one sbatch option"]),
    ("--reservation=rl\n--output=/tmp/x", ["control character '\\n'", "one line"]),
    ("--reservation=rl\r", ["control character '\\r'"]),
    ("--output=/home/other/log", ["--output is not valid", "the launcher sets it"]),
    ("--out=/home/other/log", ["--output is not valid"]),
    ("--error=/tmp/e", ["--error is not valid"]),
    ("--time=10", ["set it with scheduler.slurm.<group>.time"]),
    ("--gpus-per-node=8", ["scheduler.slurm.<group>.gpus_per_node"]),
    ("--signal=USR1@10", ["scheduler.slurm.signal_seconds"]),
    ("--no-requeue", ["scheduler.slurm.requeue"]),
    ("--array=0-3", ["--array is not valid"]),
    ("--comment=my hetjob", ["'hetjob'"]),
])
def test_extra_sbatch_refuses_anything_but_one_option_of_its_own(line, words):
    with pytest.raises(ConfigError) as e:
        SlurmGroupConfig(extra_sbatch=["--contiguous", line])
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("line, why", [
    ("--wait", "sbatch would not return until the job ends"),
    ("--wai", "--wait is not valid"),
    ("--hold", "held, for ever"),
    ("--test-only", "sbatch would submit nothing"),
    ("--test", "--test-only is not valid"),
    ("-W", "not one sbatch option"),
    ("-H", "not one sbatch option"),
    ("--clusters=other", "squeue and scancel do not look"),
    ("--cluster=other", "--clusters is not valid"),
    ("-M other", "not one sbatch option"),
])
def test_extra_sbatch_refuses_options_that_keep_sbatch_from_submitting_at_once(line, why):
    """``sbatch --parsable`` must print a job id at once and the job must be able to start:
    ``--wait`` would block the launcher until the job ends (and leave it running after the
    submission times out), ``--hold`` would never start, ``--test-only`` submits nothing.
    ``--clusters`` would queue it where the controller never looks for it."""
    with pytest.raises(ConfigError) as e:
        SlurmGroupConfig(extra_sbatch=[line])
    message = str(e.value)
    assert "extra_sbatch[0]" in message and why in message and "\n" not in message, message


def test_every_template_expression_ends_in_a_quoting_or_checking_filter():
    """Statically (each ``{{ }}`` of both templates), and at render time: the environment
    refuses to write a value that did not come out of a filter."""
    for name in ("worker.sbatch.j2", "controller.sbatch.j2"):
        with open(os.path.join(TEMPLATES, name)) as f:
            source = f.read()
        for expr in re.findall(r"\{\{(.*?)\}\}", source, re.S):
            last = expr.rsplit("|", 1)
            assert len(last) == 2 and last[1].strip() in FILTERS, f"{name}: {{{{{expr}}}}}"
    env = template_environment()
    with pytest.raises(ConfigError, match="must end in one of the filters"):
        env.from_string("srun {{ args }}").render(args="$(touch /tmp/x)")
    assert env.from_string("srun {{ args | shq }}").render(args="$(x)") == "srun '$(x)'"


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\x00b", "a\x1bb", "a\u2028b", "a\tb"])
def test_no_filter_lets_a_control_character_through(bad):
    for f in FILTERS.values():
        with pytest.raises(ConfigError):
            f([bad] if f is FILTERS["shjoin"] else bad)
    with pytest.raises(ConfigError, match="control character"):
        sbatch_quote(bad)


@pytest.mark.parametrize("workdir", ["-x", "-", "--", "-P a"])
def test_a_relative_workdir_starting_with_a_dash_is_entered(tmp_path, monkeypatch, workdir):
    """Found by tests/fuzzing: the scripts ran ``cd -x`` (an invalid option: the workers
    started in the submit directory), ``cd -`` (the previous directory) or ``cd --`` (home).
    The directory is now made absolute from where the launcher runs, as sbatch starts the
    job there."""
    from scheduler.registry import make_scheduler
    from system.launch import build_config

    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, workdir))
    monkeypatch.chdir(tmp)
    cfg = build_config("smoke", "t1", ["scheduler=slurm", f"scheduler.slurm.workdir={workdir}"])
    paths = TrialPaths(os.path.join(tmp, "runs", "smoke", "t1"))
    scheduler = make_scheduler(cfg.scheduler, "smoke", "t1", paths.root)
    got = run_script(scheduler.plan(group_spec("master", 1, paths, "python")).materialize(), tmp)
    pwd = dict(e.split("=", 1) for e in got["srun.env"])["PWD"]
    assert pwd == os.path.join(tmp, workdir)
