"""Slurm settings: global ones and one :class:`SlurmGroupConfig` per worker group."""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List

from scheduler.script_text import (ENV_RE, ENV_VALID, check_sbatch_text, parse_sbatch_option,
                                   split_words)
from system.checks import check_int, check_line, check_lines
from system.errors import ConfigError

_MEM_RE = re.compile(r"\d+[KMGT]?")
_TIME_RE = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
_SBATCH_TEXT = ("partition", "account", "qos", "constraint", "nodelist", "exclude")
"""Fields written (quoted) on an ``#SBATCH`` line."""
_SHELL_TEXT = ("container_image", "container_mounts", "apptainer_image")
"""Fields written (quoted) as shell words."""


@dataclasses.dataclass
class SlurmGroupConfig:
    """The job of one worker group (``scheduler.slurm.<group>.<key>``). Empty strings for
    partition/account/qos/time inherit the global ``scheduler.slurm.<key>``."""

    nodes: int = 1
    """Nodes for the group's job."""
    ntasks_per_node: int = 0
    """Worker tasks per node (0: the group's count divided over its nodes, rounded up)."""
    gpus_per_node: int = 0
    """GPUs per node (``--gpus-per-node``); 0: with ``scheduler.slurm.gpus=true``, what the
    group's tasks on a node use (tasks per node x GPUs per worker), else none. Each task of a
    group that uses GPUs takes its own slice of them (by local rank)."""
    cpus_per_task: int = 1
    """CPU cores per worker task."""
    mem: str = ""
    """Memory per node, e.g. ``64G`` (empty: the partition's default)."""
    partition: str = ""
    """Partition (empty: the global one)."""
    account: str = ""
    """Account (empty: the global one)."""
    qos: str = ""
    """Quality of service (empty: the global one)."""
    time: str = ""
    """Time limit, e.g. ``04:00:00`` or ``2-00:00:00`` (empty: the global one); the formats
    and the shortest one allowed are those of ``scheduler.slurm.time``."""
    exclusive: bool = False
    """Request whole nodes (``--exclusive``)."""
    constraint: str = ""
    """Node features (``--constraint``)."""
    nodelist: str = ""
    """Run on these nodes (``--nodelist``)."""
    exclude: str = ""
    """Never run on these nodes (``--exclude``)."""
    extra_sbatch: List[str] = dataclasses.field(default_factory=list)
    """Site-specific directives, one ``--option`` or ``--option=value`` each, without
    ``#SBATCH``, e.g. ``[--reservation=rl]``; the value is written quoted. Options the
    launcher sets itself (resources, names, logs, signal, requeue) are refused."""
    setup: List[str] = dataclasses.field(default_factory=list)
    """Shell lines run before the workers start (module loads, venv activation...), written
    as they are: shell code, one line each."""
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    """Environment variables exported to the workers."""
    container_image: str = ""
    """Pyxis/enroot image: adds ``--container-image`` to ``srun``."""
    container_mounts: str = ""
    """Pyxis mounts (``--container-mounts``), e.g. ``/data:/data``."""
    apptainer_image: str = ""
    """Apptainer image: the worker runs under ``apptainer exec [apptainer_args] IMAGE``."""
    apptainer_args: str = "--nv"
    """Extra arguments of ``apptainer exec``, split like shell words and each written quoted
    (``--nv --bind "/a b:/data"``)."""

    def __post_init__(self) -> None:
        for key in ("nodes", "cpus_per_task"):
            check_int(key, getattr(self, key), 1)
        for key in ("ntasks_per_node", "gpus_per_node"):
            check_int(key, getattr(self, key), 0)
        for key in _SBATCH_TEXT:
            check_sbatch_text(key, getattr(self, key))
        for key in _SHELL_TEXT:
            check_line(key, getattr(self, key))
        check_slurm_time("time", self.time)
        check_line("mem", self.mem)
        if self.mem and not _MEM_RE.fullmatch(self.mem):
            raise ConfigError(f"mem={self.mem!r} is not valid; valid: an integer (megabytes) "
                              "with an optional K/M/G/T suffix, e.g. 64G, 512M, 16000")
        if self.container_image and self.apptainer_image:
            raise ConfigError("set container_image (pyxis) or apptainer_image, not both")
        split_words("apptainer_args", self.apptainer_args)
        self._check_lists()

    def _check_lists(self) -> None:
        """``env``, ``setup`` and ``extra_sbatch``: one line per entry, valid names/options."""
        if not isinstance(self.env, dict):
            raise ConfigError(f"env={self.env!r} must be a map of variable names to strings")
        for k, v in self.env.items():
            if not (isinstance(k, str) and ENV_RE.fullmatch(k)):
                raise ConfigError(f"env: {k!r} is not a valid variable name; valid: {ENV_VALID}")
            check_line(f"env[{k!r}]", v)
        check_lines("setup", self.setup)
        check_lines("extra_sbatch", self.extra_sbatch)
        for i, line in enumerate(self.extra_sbatch):
            parse_sbatch_option(f"extra_sbatch[{i}]", line)


_NO_LIMIT = ("UNLIMITED", "INFINITE")
"""Slurm's words for no time limit (any case)."""


def check_slurm_time(key: str, value: str) -> None:
    """A Slurm time limit: minutes, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``, or ``UNLIMITED``/``INFINITE`` (empty: inherited/the partition's)."""
    check_line(key, value)
    if value and not (_TIME_RE.fullmatch(value) or value.upper() in _NO_LIMIT):
        raise ConfigError(f"{key}={value!r} is not valid; valid: minutes, MM:SS, "
                          "[D-]HH:MM:SS such as 04:00:00 or 2-00:00:00, D-HH, D-HH:MM, "
                          "or UNLIMITED")


def slurm_time_seconds(value: str) -> int | None:
    """The time limit ``value`` (checked by :func:`check_slurm_time`) in seconds, as Slurm
    counts it: a whole number of minutes, seconds rounded up. None for no limit of its own:
    empty (inherited, or the partition's), ``0`` (Slurm: no limit), ``UNLIMITED``,
    ``INFINITE``. Without a day, one field is minutes, two ``MM:SS``, three ``HH:MM:SS``;
    after ``D-`` they are ``HH[:MM[:SS]]``."""
    if not value or value.upper() in _NO_LIMIT:
        return None
    days, _, clock = value.rpartition("-")
    fields = [int(f) for f in clock.split(":")]
    if days or len(fields) == 3:  # [D-]HH[:MM[:SS]]
        hours, minutes, seconds = (fields + [0, 0])[:3]
    else:  # MM[:SS]
        hours, minutes, seconds = 0, fields[0], (fields + [0])[1]
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return None if total == 0 else -(-total // 60) * 60


SIGNAL_EARLY_S = 60
"""Slurm may send the ``--signal`` up to this many seconds earlier than asked (its event
resolution, sbatch(1))."""


def min_time_s(signal_seconds: int) -> int:
    """The shortest time limit that lets a requeued job do work: SIGUSR2 comes
    ``signal_seconds`` before the limit (up to :data:`SIGNAL_EARLY_S` earlier), so the limit
    must be at least twice ``signal_seconds`` plus that: the workers then run at least as long
    before the warning as they get after it. A shorter limit warns every job at once, and each
    requeues over and over without ever working."""
    return 2 * signal_seconds + SIGNAL_EARLY_S


def short_limit_message(job_id: str, kind: str, time_limit: str, signal_seconds: int) -> str:
    """Why requeued job ``job_id`` (group ``kind``) will requeue over and over: its time limit
    as Slurm has it (``TimeLimit``: set after submission, or the partition's ``DefaultTime``
    for a group without one of its own, neither seen at launch) is below :func:`min_time_s`;
    '' if it is not (pure). It requeued every 30 s, each time "not a failure", for good."""
    try:
        limit = slurm_time_seconds(time_limit) if time_limit else None
    except ValueError:  # (``Partition_Limit``, ``NONE``: no limit of the job's own to judge)
        limit = None
    need = min_time_s(signal_seconds)
    if limit is None or limit >= need:
        return ""
    return (f"job {job_id} of the {kind} group was requeued with a time limit of {limit} s "
            f"(Slurm's TimeLimit={time_limit}: set on the job, or the partition's DefaultTime), "
            f"too short for scheduler.slurm.signal_seconds={signal_seconds}: SIGUSR2 stops it "
            f"at once and it requeues over and over; valid: a time limit of at least {need} s "
            f"(scheduler.slurm.{kind}.time or scheduler.slurm.time), a smaller signal_seconds, "
            "or scheduler.slurm.requeue=false")


WORKER_GROUPS = ("master", "model", "generation", "rollout")
"""The groups of worker jobs (the ``controller``'s own job, with ``--detach``, is not one)."""


def _group(**kw: object) -> SlurmGroupConfig:
    return SlurmGroupConfig(**kw)  # type: ignore[arg-type]


@dataclasses.dataclass
class SlurmConfig:
    """Slurm jobs of a trial (``scheduler=slurm``)."""

    partition: str = ""
    """Default partition of every job (empty: the cluster's default)."""
    account: str = ""
    """Default account of every job."""
    qos: str = ""
    """Default quality of service of every job."""
    time: str = ""
    """Default time limit of every job (empty: the partition's): minutes, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS`` or ``UNLIMITED``. With ``requeue``, a
    job's limit must be at least 2 x ``signal_seconds`` + 60 s (Slurm may send SIGUSR2 up to
    60 s early), or every job would stop and requeue at once, over and over."""
    signal_seconds: int = 120
    """Seconds before the time limit at which workers, and a ``--detach`` controller, get
    SIGUSR2 to stop gracefully."""
    requeue: bool = True
    """Jobs may be requeued (``--requeue``): after a worker got SIGUSR2, its job's batch script
    requeues the job once srun has returned, and the workers rejoin the trial. A ``--detach``
    controller of a training trial warned so checkpoints, stops the trial and requeues its own
    job, which continues the trial from that checkpoint when it starts again."""
    poll_interval: float = 2.0
    """Seconds between ``squeue`` polls."""
    rejoin_timeout: float = 900.0
    """Seconds the controller waits for a requeued job's workers to register again."""
    requeue_release: float = 5.0
    """Seconds after a requeued job is first seen held back (Slurm's ``BeginTime`` hold, about
    two minutes) before the scheduler makes it eligible again (``scontrol update
    StartTime=now``), so a preempted worker rejoins as soon as resources allow; 0 leaves
    Slurm's hold alone. Not within the second of the requeue: slurmd refuses a job whose
    credential was revoked in that same second."""
    requeue_grace: float = 30.0
    """Seconds the controller waits, after a worker failed a start-up call (configure, start),
    for its job to show a requeue before it fails the trial. With ``hetjob`` at least
    ``signal_seconds``: the whole job requeues only once every group's workers stopped."""
    gpus: bool = False
    """Request GPUs for the groups that use them: one per model worker, the tensor-parallel
    size per generation server (``--gpus-per-node`` = tasks per node x that, unless the group
    sets ``gpus_per_node``); each task sees only its own (``CUDA_VISIBLE_DEVICES`` narrowed by
    local rank). false: only a group's own ``gpus_per_node`` requests any."""
    queue_timeout: float = 0.0
    """Seconds a group's job may wait in the queue before the trial fails (0: wait as long as
    Slurm keeps it; a reason that can never clear, e.g. ``InvalidQOS`` or a per-job QOS limit,
    fails it at once either way). The register timeout (``controller.register_timeout``) of a
    group starts only once its job runs."""
    hetjob: bool = False
    """Submit the worker groups as ONE heterogeneous job (one component per group, each started
    by ``srun --het-group``), so Slurm starts them together or not at all: no group holds its
    nodes while another waits. Components never share a node (one node per group at least:
    never on a single-node partition). A requeue requeues every group; a recovery's restart of
    one group runs as a job of its own beside it."""
    python: str = ""
    """Python executable on the compute nodes (empty: the launcher's own)."""
    workdir: str = ""
    """Directory the workers start in (empty: this project's root; a relative one is taken
    from where the launcher runs, as sbatch would)."""
    master: SlurmGroupConfig = dataclasses.field(default_factory=SlurmGroupConfig)
    """The master worker's job."""
    model: SlurmGroupConfig = dataclasses.field(default_factory=SlurmGroupConfig)
    """The model workers' job (set gpus_per_node on a GPU cluster)."""
    generation: SlurmGroupConfig = dataclasses.field(default_factory=SlurmGroupConfig)
    """The generation servers' job (set gpus_per_node on a GPU cluster)."""
    rollout: SlurmGroupConfig = dataclasses.field(default_factory=SlurmGroupConfig)
    """The rollout workers' job (CPU)."""
    controller: SlurmGroupConfig = dataclasses.field(default_factory=SlurmGroupConfig)
    """The controller's own job with ``--detach``."""

    def __post_init__(self) -> None:
        check_int("signal_seconds", self.signal_seconds, 0)
        if self.requeue_release < 0:
            raise ConfigError(f"requeue_release must be >= 0, got {self.requeue_release}")
        if self.requeue_grace < 0:
            raise ConfigError(f"requeue_grace must be >= 0, got {self.requeue_grace}")
        if self.queue_timeout < 0:
            raise ConfigError(f"queue_timeout must be >= 0 seconds (0: no limit), got "
                              f"{self.queue_timeout}")
        if self.poll_interval <= 0:
            raise ConfigError(f"poll_interval must be > 0, got {self.poll_interval}")
        check_slurm_time("time", self.time)
        for key in ("partition", "account", "qos"):
            check_sbatch_text(key, getattr(self, key))
        for key in ("python", "workdir"):
            check_line(key, getattr(self, key))
        self._check_time_limits()

    def _check_time_limits(self) -> None:
        """With ``requeue``, each worker group's time limit (its own, else the global one)
        leaves room for work before the SIGUSR2 warning (:func:`min_time_s`); the controller's
        own job is checked with ``--detach`` only (:meth:`check_time_limit`)."""
        for kind in WORKER_GROUPS:
            self.check_time_limit(kind)

    def check_time_limit(self, kind: str) -> None:
        """With ``requeue``, group ``kind``'s time limit leaves room for work before the SIGUSR2
        warning (:func:`min_time_s`), or every job would be warned at once and requeue over
        and over; ConfigError naming the key."""
        if not self.requeue:
            return
        need = min_time_s(self.signal_seconds)
        own = self.group(kind).time
        key = f"scheduler.slurm.{kind}.time" if own else "scheduler.slurm.time"
        limit = slurm_time_seconds(own or self.time)
        if limit is not None and limit < need:
            raise ConfigError(
                f"{key}={own or self.time!r} ({limit} s) is too short for "
                f"scheduler.slurm.signal_seconds={self.signal_seconds}: SIGUSR2 would stop "
                f"{'the controller' if kind == 'controller' else 'each job'} at once and "
                "requeue it over and over; valid: a time limit of at "
                f"least {need} s (2 x signal_seconds + {SIGNAL_EARLY_S} s), a smaller "
                "signal_seconds, or scheduler.slurm.requeue=false")

    def group(self, kind: str) -> SlurmGroupConfig:
        return getattr(self, kind)
