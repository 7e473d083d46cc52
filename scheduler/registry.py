"""Build the scheduler a config names."""
from __future__ import annotations

from typing import Any

from scheduler.base import Scheduler, SchedulerKind
from system.errors import ConfigError


def make_scheduler(cfg: Any) -> Scheduler:
    if cfg.scheduler.type == SchedulerKind.LOCAL:
        from scheduler.local import LocalScheduler

        return LocalScheduler()
    raise ConfigError(f"scheduler.type={cfg.scheduler.type.value!r} is not available yet; "
                      "valid now: ['local']")
