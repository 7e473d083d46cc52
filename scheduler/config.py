"""The ``scheduler`` section: which scheduler starts the jobs, and each scheduler's settings."""
from __future__ import annotations

import dataclasses
import enum

from scheduler.cpu_plan import KINDS, CpuBinding
from scheduler.gpu_plan import parse_visible
from scheduler.slurm_config import SlurmConfig
from system.checks import check_line
from system.errors import ConfigError


class SchedulerKind(str, enum.Enum):
    LOCAL = "local"
    SLURM = "slurm"


@dataclasses.dataclass
class LocalConfig:
    """The local scheduler (``scheduler=local``)."""

    gpus: str = "auto"
    """GPUs the local workers share out, each model worker one, each generation server its
    tensor-parallel size, given to each worker as its ``CUDA_VISIBLE_DEVICES``: ``auto`` (the
    launcher's ``CUDA_VISIBLE_DEVICES`` if set, else every GPU ``nvidia-smi`` lists, else none:
    workers run on the CPU), ``none`` (every worker on the CPU), or comma-separated device ids,
    e.g. ``2,5,7`` (kept as given: non-contiguous ids map onto those devices)."""
    cpus: CpuBinding = dataclasses.field(default_factory=CpuBinding)
    """CPU sets, as Slurm binds tasks to theirs: by default (``auto``), on a machine whose
    workers use no GPU, model workers and generation servers get disjoint CPUs, so an async
    trial overlaps training with generation (``scheduler.local.cpus.mode=off``: no binding;
    ``scheduler.local.cpus.model=0-3``: a kind's CPUs by hand)."""
    spares: bool = True
    """With recovery on: keep one warm spare process per worker group, already past its
    imports, that forks the group's first workers and every restart (a restart then skips about
    4-8 s of imports; each spare holds a few hundred MB). Not for workers given GPUs (CUDA fixes
    a process's devices when it first initialises). Slurm has none (a restart there is a
    requeue). ``false``: every worker is a process of its own."""
    spare_kinds: str = ""
    """The worker kinds that get a warm spare, comma-separated (e.g. ``model,master``: those
    whose restart stops training); empty: every kind. Each spare holds its imports' memory, and
    a generation server's spare a whole engine from a minute in (about 0.9 GB for
    arith-tiny)."""
    share_gpus: bool = False
    """Fewer GPUs than workers need (a one-GPU machine): hand them out round-robin, so workers
    share devices, instead of refusing to start; then leave the trainer room on a shared GPU
    (e.g. ``rl.vllm.gpu_memory_utilization=0.4``)."""

    def __post_init__(self) -> None:
        check_line("gpus", self.gpus)
        wrong = sorted(set(self.kinds_with_spares()) - set(KINDS))
        if wrong:
            raise ConfigError(f"spare_kinds={self.spare_kinds!r}: no worker kind {wrong[0]!r}; "
                              f"valid: empty (every kind) or some of {', '.join(KINDS)}")
        if self.gpus not in ("auto", "none"):
            try:
                ids = parse_visible(str(self.gpus))
            except ConfigError as e:
                raise ConfigError(f"gpus={self.gpus!r}: {e}; valid: auto, none or device ids "
                                  "such as 0,2,5") from None
            if not ids:
                raise ConfigError(f"gpus={self.gpus!r} names no device; valid: auto, none or "
                                  "device ids such as 0,2,5")

    def kinds_with_spares(self) -> tuple[str, ...]:
        """The kinds :attr:`spare_kinds` names (every kind when it is empty)."""
        named = tuple(k.strip() for k in str(self.spare_kinds).split(",") if k.strip())
        return named or KINDS


@dataclasses.dataclass
class SchedulerConfig:
    """How worker jobs are started."""

    type: SchedulerKind = SchedulerKind.LOCAL
    """``local`` (subprocesses on this machine) or ``slurm`` (sbatch jobs)."""
    stop_grace: float = 5.0
    """Seconds between the polite stop (SIGTERM) and SIGKILL / forced cancel."""
    local: LocalConfig = dataclasses.field(default_factory=LocalConfig)
    """Local scheduler settings (GPU placement)."""
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    """Slurm job settings (used with ``scheduler=slurm``)."""

    def __post_init__(self) -> None:
        if isinstance(self.type, str) and not isinstance(self.type, SchedulerKind):
            try:
                self.type = SchedulerKind(self.type)
            except ValueError:
                raise ConfigError(f"type={self.type!r} is not one of "
                                  f"{[k.value for k in SchedulerKind]}") from None
        if self.stop_grace < 0:
            raise ConfigError(f"stop_grace must be >= 0, got {self.stop_grace}")
