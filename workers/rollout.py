"""Rollout workers: run agents and environments, call generation servers, push trajectories."""
from __future__ import annotations

import dataclasses

from system import names
from system.checks import check_count
from system.errors import ConfigError
from system.streams import StreamPusher
from workers.base import Worker
from workers.client import WorkerClient
from workers.schema import WorkerSetup


@dataclasses.dataclass
class RolloutWorkerConfig:
    """Rollout workers (CPU processes)."""

    count: int = 4
    """How many rollout workers."""
    push_timeout: float = 60.0
    """Seconds a push may wait while the master's bounded queue is full."""

    def __post_init__(self) -> None:
        check_count("count", self.count)
        if self.push_timeout <= 0:
            raise ConfigError(f"push_timeout must be > 0, got {self.push_timeout}")


class RolloutWorker(Worker):
    kind = "rollout"
    cuts_in_flight = True  # (its episodes: see Worker.stop_by)

    def on_configure(self, config: WorkerSetup) -> None:
        self.rollout_cfg = RolloutWorkerConfig(**config["worker"])

    def trajectory_stream(self, name: str = "trajectories", timeout: float = 60.0) -> StreamPusher:
        """A pusher connected to the master's stream ``name`` (waits for it to be published,
        until this worker is told to stop)."""
        address = self.name_resolve.wait(names.stream(self.exp, self.trial, name), timeout,
                                         stop=lambda: self.stopping)
        return StreamPusher(self.codec, address, self.rpc_cfg.stream_hwm)


class RolloutClient(WorkerClient):
    """The rollout worker's RPC surface: only the control calls (it is a client of the master
    and of the generation servers, and serves nothing else)."""
