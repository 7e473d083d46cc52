"""The root experiment config, composed of the dataclasses each component owns.

Every section validates itself at construction (``__post_init__`` raising
:class:`~system.errors.ConfigError` that names the key). Experiments extend
:class:`ExperimentConfig` with a section of their own (e.g. ``smoke``).
"""
from __future__ import annotations

import dataclasses
import enum
import os

from scheduler.config import SchedulerConfig, SchedulerKind
from scheduler.gpu_plan import GpuDemand
from scheduler.script_text import PATH_REFUSED, check_sbatch_text, slurm_path_problem
from system.checks import check_line, check_name
from system.errors import ConfigError
from system.name_resolve import NameResolveConfig
from system.rpc import RpcConfig
from workers.generation import GenerationServerConfig
from workers.master import MasterConfig
from workers.model import ModelWorkerConfig
from workers.rollout import RolloutWorkerConfig

@dataclasses.dataclass
class ClusterConfig:
    """Where the trial's files live and which network interface its sockets use."""

    fileroot: str = "./runs"
    """Root of trial directories (``<fileroot>/<exp>/<trial>/``); a shared filesystem on a cluster."""
    interface: str = ""
    """Address sockets bind to; empty: loopback under the local scheduler, the node's address
    under Slurm."""
    group_readable: bool = False
    """Let the trial's group read its files: logs, configs, checkpoints, metrics and job scripts
    are created 0640 and directories 0750 (umask 027) instead of 0600/0700 (umask 077). The secret
    stays 0600 and name-resolution entries stay private either way."""

    def __post_init__(self) -> None:
        check_line("fileroot", self.fileroot)
        check_line("interface", self.interface)
        if not self.fileroot:
            raise ConfigError("fileroot must not be empty; valid: a directory path")


@dataclasses.dataclass
class ControllerConfig:
    """The controller that starts, watches and stops the workers."""

    register_timeout: float = 120.0
    """Seconds a worker has to register once its job runs, before the trial gives up (naming the
    missing ones). Time in the scheduler's queue does not count (see
    ``scheduler.slurm.queue_timeout``), nor, at the start, the wait for a warm spare to make its
    imports (local scheduler; at most as long again, and 300 s, then the group starts processes
    of its own)."""
    heartbeat_ttl: float = 5.0
    """Seconds after which a worker whose heartbeat key was not refreshed counts as dead."""
    hang_grace: float = 30.0
    """Seconds more for a silent worker whose own process the scheduler sees running (a local
    process, a Slurm job of that one worker) before it counts as hung: a busy machine can
    starve a heartbeat thread for seconds (an import that holds the interpreter lock). A
    worker whose process ended is judged at once; a master that does not answer gets the same
    grace. 0: judge at the heartbeat's expiry."""
    poll_interval: float = 0.2
    """Seconds between checks of job states, heartbeats and master progress."""
    timeout: float = 0.0
    """Stop the trial as failed after this many seconds (0: no limit)."""
    stall_timeout: float = 900.0
    """Treat the master as failed when its progress has not changed for this many seconds
    (0: never)."""
    orphan_timeout: float = 60.0
    """Workers stop by themselves once the controller's liveness key has been gone this many
    seconds (a launcher that died without stopping them, ``--detach`` included)."""
    progress: bool = True
    """Show a live one-line progress display in the launching terminal."""

    def __post_init__(self) -> None:
        for key in ("register_timeout", "heartbeat_ttl", "poll_interval"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)}")
        for key in ("timeout", "stall_timeout", "hang_grace"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.orphan_timeout <= 0:
            raise ConfigError(f"orphan_timeout must be > 0, got {self.orphan_timeout}")


class RunMode(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class RecoverMode(str, enum.Enum):
    AUTO = "auto"
    RESUME = "resume"
    OFF = "off"


@dataclasses.dataclass
class RecoverConfig:
    """What happens to an existing trial and to workers that die (``recover=auto|resume|off``)."""

    type: RecoverMode = RecoverMode.AUTO
    """auto: continue an existing trial from its latest checkpoint, and restart the workers
    that hold training state (master, model workers) from it when one dies; resume: continue
    from the latest checkpoint, but a death ends the trial; off: start fresh (refused for a
    trial that has checkpoints unless recover.overwrite=true)."""
    retries: int = 3
    """Automatic recoveries per trial before a failure ends it."""
    backoff: float = 1.0
    """Seconds before a recovery whose previous attempt's workers failed again within a
    minute (a crash loop), doubled for each such attempt in a row; a recovery after an
    independent failure starts at once."""
    overwrite: bool = False
    """With recover=off: delete the trial's checkpoints and start over."""

    def __post_init__(self) -> None:
        if isinstance(self.type, str) and not isinstance(self.type, RecoverMode):
            try:
                self.type = RecoverMode(self.type)
            except ValueError:
                raise ConfigError(f"type={self.type!r} is not one of "
                                  f"{[m.value for m in RecoverMode]}") from None
        if self.retries < 0 or self.backoff < 0:
            raise ConfigError("retries and backoff must be >= 0")
        if self.overwrite and self.type != RecoverMode.OFF:  # (it continued, silently)
            raise ConfigError(f"overwrite=true starts a trial over, which only recover=off "
                              f"does (recover={self.type.value} continues it from its "
                              "checkpoints); valid: recover=off recover.overwrite=true")

    @property
    def resume(self) -> bool:
        """Whether a (re)started master and model workers restore the latest checkpoint."""
        return self.type in (RecoverMode.AUTO, RecoverMode.RESUME)


WANDB_MODES = ("off", "offline", "online")


@dataclasses.dataclass
class MetricsConfig:
    """Where an experiment's training metrics go besides ``metrics.jsonl`` and TensorBoard (always
    written)."""

    wandb: str = "off"
    """Weights & Biases: off, offline (a run directory under ``<trial>/wandb``, nothing sent;
    ``wandb sync`` uploads it later) or online (needs network access and a W&B login)."""
    wandb_project: str = "slurm-rl"
    """The W&B project of the run (the run is named ``<exp>/<trial>``)."""
    wandb_entity: str = ""
    """The W&B team or user (empty: the login's default)."""

    def __post_init__(self) -> None:
        if self.wandb not in WANDB_MODES:
            raise ConfigError(f"wandb={self.wandb!r} is not one of {list(WANDB_MODES)}")
        if not self.wandb_project or "/" in self.wandb_project:
            raise ConfigError(f"wandb_project={self.wandb_project!r} must be a non-empty name "
                              "without '/'")


@dataclasses.dataclass
class ExperimentConfig:
    """The root config of one trial."""

    exp: str = ""
    """Experiment name (set by ``exp=NAME``)."""
    mode: RunMode = RunMode.TRAIN
    """train: run the experiment; eval: evaluate every saved checkpoint of the trial (generation
    servers and the master only; files under ``<trial>/eval/``, the trial's own untouched)."""
    trial: str = ""
    """Trial name (set by ``trial=T``); the trial directory is ``<fileroot>/<exp>/<trial>``."""
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    """Paths and network."""
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    """How jobs are started (``scheduler=local|slurm``)."""
    name_resolve: NameResolveConfig = dataclasses.field(default_factory=NameResolveConfig)
    """How workers find each other (``name_resolve=file|redis``)."""
    rpc: RpcConfig = dataclasses.field(default_factory=RpcConfig)
    """Sockets and wire limits."""
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    """Registration, liveness and progress."""
    master: MasterConfig = dataclasses.field(default_factory=MasterConfig)
    """The master worker."""
    model: ModelWorkerConfig = dataclasses.field(default_factory=ModelWorkerConfig)
    """Model (training) workers."""
    generation: GenerationServerConfig = dataclasses.field(default_factory=GenerationServerConfig)
    """Generation servers."""
    rollout: RolloutWorkerConfig = dataclasses.field(default_factory=RolloutWorkerConfig)
    """Rollout workers."""
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    """Training metrics besides metrics.jsonl and TensorBoard (``metrics.wandb=offline``; the RL
    experiments log them, smoke has none)."""

    def __post_init__(self) -> None:
        check_name("exp", self.exp)
        check_name("trial", self.trial)
        if not isinstance(self.mode, RunMode):
            try:
                self.mode = RunMode(self.mode)
            except ValueError:
                raise ConfigError(f"mode={self.mode!r} is not one of "
                                  f"{[m.value for m in RunMode]}") from None
        problem = slurm_path_problem(self.cluster.fileroot)
        if self.scheduler.type == SchedulerKind.SLURM and problem:
            raise ConfigError(f"cluster.fileroot={self.cluster.fileroot!r} contains {problem}; "
                              f"valid with scheduler=slurm: a path without {PATH_REFUSED}")
        if self.scheduler.type == SchedulerKind.SLURM:  # job names and log paths: #SBATCH lines
            check_sbatch_text("trial", self.trial)
            check_sbatch_text("cluster.fileroot", self.cluster.fileroot)

    def check_paths(self) -> None:
        """Checks against the file system, made once the overrides are applied (not at
        construction: ``--help`` and the defaults touch no disk): ``cluster.fileroot`` must be,
        or be creatable as, a directory (:func:`fileroot_problem`)."""
        problem = fileroot_problem(self.cluster.fileroot)
        if problem:
            raise ConfigError(f"cluster.fileroot={self.cluster.fileroot}: {problem}")

    def check_machine(self) -> None:
        """Checks against the machine the launcher runs on, made before anything starts: a
        :class:`ConfigError` naming the key (exit code 1). Experiments with such limits add them
        (the RL experiments: ``rl.vllm.tensor_parallel_size`` on CPU)."""

    def recovery(self) -> RecoverConfig | None:
        """The trial's recovery settings; None for experiments without checkpoints (and for
        runs that are not recovered)."""
        return None

    def worker_counts(self) -> dict[str, int]:
        """Workers per kind; an evaluation (``mode=eval``) starts the master and the generation
        servers only."""
        train = self.mode == RunMode.TRAIN
        return {"master": 1, "model": self.model.count if train else 0,
                "generation": self.generation.count,
                "rollout": self.rollout.count if train else 0}

    def gpu_demands(self) -> list[GpuDemand]:
        """The GPUs each worker kind uses where GPUs are placed (model workers first): one per
        model worker and one per generation server; an experiment whose servers span several
        (tensor parallelism) says so. Master and rollout workers use none."""
        return [GpuDemand("model", self.worker_counts()["model"], 1, "model.count"),
                GpuDemand("generation", self.generation.count, 1, "generation.count")]


def fileroot_problem(fileroot: str) -> str | None:
    """Why ``fileroot`` cannot be the root of trial directories, found without writing: it, or
    the nearest of its parents that exists, is not a directory; None when it may be. (Whether it
    can be created and written shows only when the trial directory is: a read-only mount,
    ``/sys``, permissions, which root ignores.)"""
    path = os.path.abspath(fileroot)
    while not os.path.isdir(path):
        if os.path.lexists(path):  # (one that cannot be read looks absent: its parent is checked)
            return f"not a directory ({path} is not a directory; valid: a directory path)"
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None
