"""Pure rendering of sbatch scripts from ``slurm/*.sbatch.j2`` (golden-file tested).

Every ``{{ ... }}`` of a template ends in a filter of :mod:`scheduler.script_text` that quotes
or checks its value; the environment refuses anything else. Paths in Slurm filename patterns
(``--output``) have their ``%`` doubled, so Slurm writes exactly the log paths the controller
reads."""
from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

import jinja2

from scheduler.base import GroupSpec
from scheduler.script_text import FILTERS, PATH_REFUSED, finalize, slurm_path_problem
from scheduler.slurm_config import SlurmConfig, SlurmGroupConfig
from scheduler.slurm_fit import Demand, mem_mb
from scheduler.slurm_marks import requeue_mark_prefix
from system.errors import ConfigError

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slurm")


def template_environment() -> jinja2.Environment:
    """The Jinja2 environment of the sbatch templates: the filters of
    :mod:`scheduler.script_text`, and nothing written unfiltered."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False, finalize=finalize)
    env.filters.update(FILTERS)
    return env


def job_name(exp: str, trial: str, kind: str) -> str:
    return f"{exp}_{trial}:{kind}"


def job_label(group: GroupSpec) -> str:
    """What names ``group``'s job: ``kind`` for a group, ``kind.<first>`` for a job that runs
    worker ``first`` alone (a recovery's restart of one worker)."""
    return f"{group.kind}.{group.first}" if group.first else group.kind


def script_name(group: GroupSpec) -> str:
    """The file name of ``group``'s script under the trial's ``jobs/``: ``kind.sbatch``, or
    ``kind-<first>.sbatch`` for a single worker's job (the group's own script stays)."""
    return f"{group.kind}-{group.first}.sbatch" if group.first else f"{group.kind}.sbatch"


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


def job_gpus(kind: str, tasks_on_node: int, g: SlurmGroupConfig, slurm: SlurmConfig,
             gpus_per_worker: int) -> tuple[int, int]:
    """``(GPUs per node, GPUs per task)`` of a job that runs ``tasks_on_node`` tasks of
    ``kind`` per node, each worker using ``gpus_per_worker``: the group's own
    ``gpus_per_node``, or with ``scheduler.slurm.gpus`` what its tasks use; each task gets its
    own slice (0: no binding, a group that uses no GPUs or requests none). ConfigError, naming
    the keys, when the group's ``gpus_per_node`` cannot give every task its own."""
    need = tasks_on_node * gpus_per_worker
    per_node = g.gpus_per_node or (need if slurm.gpus else 0)
    if not per_node or not gpus_per_worker:
        return per_node, 0
    if per_node < need:
        raise ConfigError(f"scheduler.slurm.{kind}.gpus_per_node={per_node} cannot give each of "
                          f"{tasks_on_node} {kind} task(s) per node its own {gpus_per_worker} "
                          f"GPU(s); valid: >= {need}, or 0 with scheduler.slurm.gpus=true "
                          f"(or lower the {kind} workers per node: scheduler.slurm.{kind}.nodes)")
    return per_node, gpus_per_worker


def slurm_literal(path: str) -> str:
    """``path`` inside a Slurm filename pattern (``#SBATCH --output``, ``srun --output``):
    ``%`` doubled, so Slurm writes exactly ``path``; ConfigError for a path no pattern can
    name (:func:`~scheduler.script_text.slurm_path_problem`)."""
    problem = slurm_path_problem(path)
    if problem:
        raise ConfigError(f"the log path {path!r} contains {problem}; valid: a "
                          f"cluster.fileroot (and working directory) without {PATH_REFUSED}")
    return path.replace("%", "%%")


def task_log(group: GroupSpec) -> str:
    """``srun --output`` such that worker ``first + i`` writes exactly ``log_paths[i]``: the
    path itself for one worker, else a ``%t`` (task rank) pattern; refused (ConfigError) when
    no pattern gives them all, e.g. workers from past 0 (ranks count from 0)."""
    paths = group.log_paths
    if group.count == 1:
        return slurm_literal(paths[0])
    if group.first:
        raise ConfigError(f"the {group.kind} job of workers {group.first}.."
                          f"{group.first + group.count - 1}: a Slurm job starting past worker 0 "
                          "runs one worker alone")
    head = os.path.commonprefix([paths[0], paths[1]])
    tail = paths[0][len(head) + 1:]
    if any(p != f"{head}{i}{tail}" for i, p in enumerate(paths)):
        raise ConfigError(f"the log paths of the {group.kind} workers ({paths[0]} ..) are not "
                          "one srun --output pattern with the task rank")
    return f"{slurm_literal(head)}%t{slurm_literal(tail)}"


def umask_text(umask: int) -> str:
    """``0077``: a umask as the shell and ``SLURM_UMASK`` write it."""
    if not 0 <= umask <= 0o777:
        raise ConfigError(f"umask {umask:o} is not a file-creation mask")
    return f"{umask:04o}"


def render_worker_script(*, exp: str, trial: str, group: GroupSpec, slurm: SlurmConfig,
                         workdir: str, umask: int, gpus_per_worker: int = 0) -> str:
    """The sbatch script of ``group``'s job: its ``srun`` starts ``count`` tasks running
    ``argv``, task ``i`` being worker ``first + i`` (``RLSYS_WORKER_BASE``) and writing
    ``log_paths[i]``. A job of one worker (a one-worker group, or a recovery's restart of one
    worker alone) asks for one node, with the group's per-node resources. The script and srun's
    tasks create files under ``umask`` (srun passes ``SLURM_UMASK`` on, before its own umask).
    Each worker uses ``gpus_per_worker`` GPUs (:func:`job_gpus`: requested per node, and
    ``RLSYS_GPUS_PER_TASK`` tells each task to take its own slice)."""
    kind, g = group.kind, slurm.group(group.kind)
    per_node = tasks_per_node(kind, group.count, g) if group.count != 1 else 1
    gpus_per_node, gpus_per_task = job_gpus(kind, per_node, g, slurm, gpus_per_worker)
    logs_dir = os.path.dirname(group.log_paths[0])
    return template_environment().get_template("worker.sbatch.j2").render(
        exp=exp, trial=trial, kind=kind, count=group.count, first=group.first, g=g,
        nodes=g.nodes if group.count != 1 else 1, ntasks_per_node=per_node,
        gpus_per_node=gpus_per_node, gpus_per_task=gpus_per_task,
        job_name=job_name(exp, trial, job_label(group)),
        batch_log=os.path.join(slurm_literal(logs_dir), f"slurm-{kind}-%j.log"),
        task_log=task_log(group),
        signal_seconds=slurm.signal_seconds, requeue=slurm.requeue,
        requeue_mark=requeue_mark_prefix(logs_dir, kind),
        env={**group.env, **g.env}, workdir=workdir, umask=umask_text(umask),
        argv=group.argv, **_inherit(g, slurm))


def _component(group: GroupSpec, slurm: SlurmConfig, gpus_per_worker: int) -> dict[str, object]:
    """What the hetjob template writes of ``group``'s component (a whole group: first 0)."""
    kind, g = group.kind, slurm.group(group.kind)
    per_node = tasks_per_node(kind, group.count, g) if group.count != 1 else 1
    gpus_per_node, gpus_per_task = job_gpus(kind, per_node, g, slurm, gpus_per_worker)
    return dict(kind=kind, count=group.count, g=g, nodes=g.nodes if group.count != 1 else 1,
                ntasks_per_node=per_node, gpus_per_node=gpus_per_node,
                gpus_per_task=gpus_per_task, task_log=task_log(group),
                requeue_mark=requeue_mark_prefix(os.path.dirname(group.log_paths[0]), kind),
                env={**group.env, **g.env}, argv=group.argv, **_inherit(g, slurm))


def render_hetjob_script(*, exp: str, trial: str, groups: Sequence[GroupSpec],
                         slurm: SlurmConfig, workdir: str, umask: int,
                         gpus_per_worker: Mapping[str, int]) -> str:
    """The sbatch script of one heterogeneous job running every group of ``groups`` (whole
    groups, ``first == 0``), one component each, in order: component ``i``'s ``srun
    --het-group=i`` starts group ``i``'s workers, exactly as :func:`render_worker_script` would
    in a job of its own (same resources, environment, setup, logs and GPU slices)."""
    if len(groups) < 2 or any(g.first for g in groups):
        raise ConfigError("a heterogeneous job runs two or more whole groups")
    logs_dir = os.path.dirname(groups[0].log_paths[0])
    return template_environment().get_template("hetjob.sbatch.j2").render(
        exp=exp, trial=trial, job_name=job_name(exp, trial, HETJOB),
        batch_log=os.path.join(slurm_literal(logs_dir), f"slurm-{HETJOB}-%j.log"),
        signal_seconds=slurm.signal_seconds, requeue=slurm.requeue, workdir=workdir,
        umask=umask_text(umask),
        components=[_component(g, slurm, gpus_per_worker.get(g.kind, 0)) for g in groups])


HETJOB = "workers"
"""The label of the trial's heterogeneous job (its name is ``<exp>_<trial>:workers``; sbatch drops any #SBATCH line that says "hetjob")."""


def group_demand(kind: str, count: int, slurm: SlurmConfig, gpus_per_worker: int,
                 default_partition: str) -> Demand:
    """What the job of ``count`` workers of ``kind`` asks of each of its nodes (pure)."""
    g = slurm.group(kind)
    per_node = tasks_per_node(kind, count, g) if count != 1 else 1
    gpus, _ = job_gpus(kind, per_node, g, slurm, gpus_per_worker)
    return Demand(kind, g.partition or slurm.partition or default_partition,
                  g.nodes if count != 1 else 1, per_node * g.cpus_per_task, gpus,
                  mem_mb(g.mem), g.exclusive)


def render_controller_script(*, exp: str, trial: str, slurm: SlurmConfig, argv: Sequence[str],
                             env: Mapping[str, str], logs_dir: str, workdir: str,
                             umask: int, requeue: bool = False) -> str:
    """The sbatch script that runs the controller itself (``--detach``), creating files under
    ``umask``; Slurm writes its output to exactly ``<logs_dir>/controller.log``. ``requeue``:
    SIGUSR2 warns it ``signal_seconds`` before its time limit, and it requeues its own job
    then (see :mod:`system.launcher.self_requeue`)."""
    group = slurm.controller
    return template_environment().get_template("controller.sbatch.j2").render(
        exp=exp, trial=trial, g=group, job_name=job_name(exp, trial, "controller"),
        signal_seconds=slurm.signal_seconds, requeue=requeue,
        batch_log=os.path.join(slurm_literal(logs_dir), "controller.log"),
        env={**env, **group.env}, workdir=workdir, umask=umask_text(umask), argv=argv,
        **_inherit(group, slurm))
