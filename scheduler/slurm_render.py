"""Pure rendering of sbatch scripts from ``slurm/*.sbatch.j2`` (golden-file tested)."""
from __future__ import annotations

import math
import os
import shlex
from typing import Mapping, Sequence

import jinja2

from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from system.errors import ConfigError

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slurm")


def sbatch_quote(value: object) -> str:
    """A value for an ``#SBATCH`` line: double-quoted, ``\\`` and ``"`` escaped (sbatch's own
    directive parser understands that); newlines cannot be expressed and are refused."""
    s = str(value)
    if "\n" in s or "\r" in s:
        raise ConfigError(f"{s!r}: an #SBATCH value cannot contain a newline")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def shell_quote(value: object) -> str:
    s = str(value)
    if "\n" in s:
        raise ConfigError(f"{s!r}: a shell word in a job script cannot contain a newline")
    return shlex.quote(s)


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["sq"] = sbatch_quote
    env.filters["shq"] = shell_quote
    return env


def job_name(exp: str, trial: str, kind: str) -> str:
    return f"{exp}_{trial}:{kind}"


def _inherit(group: SlurmGroupConfig, slurm: SlurmConfig) -> dict[str, str]:
    return {k: getattr(group, k) or getattr(slurm, k) for k in ("partition", "account", "qos",
                                                                  "time")}


def tasks_per_node(kind: str, count: int, group: SlurmGroupConfig) -> int:
    n = group.ntasks_per_node or math.ceil(count / group.nodes)
    if count < 1:
        raise ConfigError(f"the {kind} group has no workers; nothing to submit")
    if n * group.nodes < count:
        raise ConfigError(f"scheduler.slurm.{kind}: {group.nodes} node(s) x {n} task(s) per node "
                          f"cannot hold {count} {kind} workers")
    if n * (group.nodes - 1) >= count:
        raise ConfigError(f"scheduler.slurm.{kind}: {group.nodes} nodes for {count} workers at "
                          f"{n} per node leaves a node empty")
    return n


def render_worker_script(*, exp: str, trial: str, kind: str, count: int, slurm: SlurmConfig,
                         argv: Sequence[str], env: Mapping[str, str], logs_dir: str,
                         workdir: str) -> str:
    """The sbatch script of one worker group; its ``srun`` starts ``count`` tasks running
    ``argv``, each writing ``<logs_dir>/<kind>-<task id>.log``."""
    group = slurm.group(kind)
    return _env().get_template("worker.sbatch.j2").render(
        exp=exp, trial=trial, kind=kind, count=count, g=group,
        ntasks_per_node=tasks_per_node(kind, count, group),
        job_name=job_name(exp, trial, kind),
        batch_log=os.path.join(logs_dir, f"slurm-{kind}-%j.log"),
        task_log=os.path.join(logs_dir, f"{kind}-%t.log"),
        signal_seconds=slurm.signal_seconds, requeue=slurm.requeue,
        requeue_mark=os.path.join(logs_dir, f".requeue-{kind}"),
        env={**env, **group.env}, workdir=workdir,
        command=" ".join(shell_quote(a) for a in argv), **_inherit(group, slurm))


def render_controller_script(*, exp: str, trial: str, slurm: SlurmConfig, argv: Sequence[str],
                             env: Mapping[str, str], logs_dir: str, workdir: str) -> str:
    """The sbatch script that runs the controller itself (``--detach``)."""
    group = slurm.controller
    return _env().get_template("controller.sbatch.j2").render(
        exp=exp, trial=trial, g=group, job_name=job_name(exp, trial, "controller"),
        batch_log=os.path.join(logs_dir, "controller.log"), env={**env, **group.env},
        workdir=workdir, command=" ".join(shell_quote(a) for a in argv),
        **_inherit(group, slurm))
