"""The master worker: runs the experiment's main loop and reports completion with its figures."""
from __future__ import annotations

import dataclasses
from typing import Any

from system.errors import ConfigError
from workers.base import Worker
from workers.client import WorkerClient


@dataclasses.dataclass
class MasterConfig:
    """The master worker (always exactly one)."""

    peer_timeout: float = 10.0
    """Seconds the master waits for a reply when it calls another worker."""
    cpus: int = 1
    """CPU cores the master's job asks for."""

    def __post_init__(self) -> None:
        if self.peer_timeout <= 0:
            raise ConfigError(f"master.peer_timeout must be > 0, got {self.peer_timeout}")
        if self.cpus < 1:
            raise ConfigError(f"master.cpus must be >= 1, got {self.cpus}")


class MasterWorker(Worker):
    kind = "master"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.task_source: Any = None  # set by an RL role: hands rollout tasks out

    def rpc_handlers(self) -> dict[str, Any]:
        return {**super().rpc_handlers(), "next_task": self.next_task}

    def next_task(self, worker: int, max_tasks: int = 1) -> dict[str, Any]:
        """Rollout workers ask for work: ``{"tasks": [...]}``, ``{"wait": seconds}`` while
        admission is closed, or ``{"done": True}``."""
        if self.task_source is None:
            return {"wait": 0.2}
        return self.task_source.next_task(int(worker), int(max_tasks))

    def on_configure(self, config: dict[str, Any]) -> None:
        self.master_cfg = MasterConfig(**config["worker"])
        self._progress: dict[str, Any] = {}

    def set_progress(self, **fields: Any) -> None:
        """Figures shown in the launcher's progress line (read through ``ping``)."""
        self._progress = dict(fields)

    def progress(self) -> dict[str, Any]:
        return getattr(self, "_progress", {})


class MasterClient(WorkerClient):
    """The master's RPC surface: the common control calls (its figures come in ``report``)."""
