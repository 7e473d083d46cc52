"""The ``scheduler`` section: which scheduler starts the jobs, and each scheduler's settings."""
from __future__ import annotations

import dataclasses
import enum

from scheduler.slurm_config import SlurmConfig
from system.errors import ConfigError


class SchedulerKind(str, enum.Enum):
    LOCAL = "local"
    SLURM = "slurm"


@dataclasses.dataclass
class SchedulerConfig:
    """How worker jobs are started."""

    type: SchedulerKind = SchedulerKind.LOCAL
    """``local`` (subprocesses on this machine) or ``slurm`` (sbatch jobs)."""
    stop_grace: float = 5.0
    """Seconds between the polite stop (SIGTERM) and SIGKILL / forced cancel."""
    spares: bool = True
    """Local scheduler, with recovery on: keep one warm spare process per worker group, already
    past its imports, that a restart takes over (a restart then skips about 4-8 s of imports;
    each spare holds a few hundred MB). Slurm has none (a restart there is a requeue)."""
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
