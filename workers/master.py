"""The master worker: runs the experiment's main loop and reports completion with its figures."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Protocol

from system import names
from system.errors import ConfigError, NameEntryNotFound
from workers.base import Worker
from workers.client import Pending, WorkerClient
from workers.schema import TaskReply, WorkerSetup


@dataclasses.dataclass
class MasterConfig:
    """The master worker (always exactly one)."""

    peer_timeout: float = 10.0
    """Seconds the master waits for a reply when it calls another worker."""
    cpus: int = 1
    """CPU cores the master's job asks for."""

    def __post_init__(self) -> None:
        if self.peer_timeout <= 0:
            raise ConfigError(f"peer_timeout must be > 0, got {self.peer_timeout}")
        if self.cpus < 1:
            raise ConfigError(f"cpus must be >= 1, got {self.cpus}")


class TaskSource(Protocol):
    """What hands rollout tasks out (the RL loop's admission-controlled source)."""

    def next_task(self, worker: int, max_tasks: int, incarnation: str = "") -> TaskReply: ...


class MasterWorker(Worker):
    kind = "master"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._task_source: TaskSource | None = None
        self._progress: dict[str, Any] = {}
        self._progress_written = 0.0

    def rpc_handlers(self) -> dict[str, Callable[..., Any]]:
        return {**super().rpc_handlers(), "next_task": self.next_task}

    def serve_tasks(self, source: TaskSource | None) -> None:
        """Hand rollout tasks out from ``source`` from now on (None: rollout workers wait)."""
        self._task_source = source

    def next_task(self, worker: int, max_tasks: int = 1, incarnation: str = "") -> TaskReply:
        """Rollout workers ask for work: ``{"tasks": [...]}``, ``{"wait": seconds}`` while
        admission is closed, or ``{"done": True}``. ``incarnation`` names the asking process
        (a restarted worker asks under a new one: what its predecessor held is released)."""
        source = self._task_source
        if source is None:
            return {"wait": 0.2}
        return source.next_task(int(worker), int(max_tasks), str(incarnation))

    def on_configure(self, config: WorkerSetup) -> None:
        self.master_cfg = MasterConfig(**config["worker"])

    def on_preempt(self) -> bool:
        """Preempted: the loop checkpoints at its next safe point, then this worker stops."""
        return self.stop_after_checkpoint()

    def preempt_requests(self) -> list[str]:
        """Keys of the workers (this one included) waiting for a checkpoint before they stop
        (SIGUSR2: a preemption warning)."""
        return sorted(self.name_resolve.find_subtree(names.preempts(self.exp, self.trial)))

    def preempts_checkpointed(self, keys: list[str]) -> None:
        """A checkpoint was committed: the workers waiting on ``keys`` may stop."""
        for key in keys:
            try:
                self.name_resolve.delete(key)
            except NameEntryNotFound:
                pass

    def set_progress(self, **fields: Any) -> None:
        """Figures shown in the launcher's progress line (read through ``ping``), also kept
        under the trial's progress key, so they outlive this process."""
        new_step = fields.get("step") != self._progress.get("step")
        self._progress = dict(fields)
        now = time.monotonic()
        if new_step or now - self._progress_written >= 1.0:  # a file write: not 20 a second
            self._progress_written = now
            self.name_resolve.add(names.progress(self.exp, self.trial),
                                  json.dumps(self._progress, default=str), replace=True)

    def progress(self) -> dict[str, Any]:
        return self._progress


class MasterClient(WorkerClient):
    """The master's RPC surface: the control calls, and the rollout workers' ``next_task``."""

    def next_task(self, worker: int, max_tasks: int, incarnation: str = ""
                  ) -> Pending[TaskReply]:
        return self._call("next_task", worker=worker, max_tasks=max_tasks,
                          incarnation=incarnation)
