"""Model workers: one per device, hosting a training engine in a dp×tp×pp layout.

Also owns the rendezvous of torch.distributed groups among model workers: a TCPStore started by
rank 0 whose ``host:port`` is published in name resolution, so groups form without a fixed port
and independently of any default process group.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from system import names
from system.errors import ConfigError
from workers.base import Worker
from workers.client import WorkerClient


@dataclasses.dataclass
class ModelWorkerConfig:
    """Model (training) workers."""

    count: int = 2
    """How many model workers (one per device)."""
    group_timeout: float = 120.0
    """Seconds to wait for all ranks when a process group forms."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ConfigError(f"model.count must be >= 0, got {self.count}")
        if self.group_timeout <= 0:
            raise ConfigError(f"model.group_timeout must be > 0, got {self.group_timeout}")


class ModelWorker(Worker):
    kind = "model"

    def on_configure(self, config: dict[str, Any]) -> None:
        self.model_cfg = ModelWorkerConfig(**config["worker"])
        self.world_size = int(config["counts"]["model"])

    @property
    def device(self) -> str:
        """This worker's device: under Slurm the job's GPUs are the visible ones
        (``CUDA_VISIBLE_DEVICES`` set from the allocation) and each task takes the one at its
        local rank; without GPUs, the CPU."""
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return "cpu"

    def new_group(self, name: str) -> Any:
        """A gloo process group over all model workers (rank = worker index), rendezvoused
        through a TCPStore whose address rank 0 publishes under ``store/<name>``."""
        import torch.distributed as dist

        key = names.store(self.exp, self.trial, name)
        timeout = datetime.timedelta(seconds=self.model_cfg.group_timeout)
        if self.index == 0:
            store = dist.TCPStore(self.host, 0, self.world_size, is_master=True,
                                  wait_for_workers=False, timeout=timeout)
            self.name_resolve.add(key, f"{self.host}:{store.port}", replace=True)
        else:
            host, port = self.name_resolve.wait(key, self.model_cfg.group_timeout).rsplit(":", 1)
            store = dist.TCPStore(host, int(port), self.world_size, is_master=False,
                                  timeout=timeout)
        self._stores = getattr(self, "_stores", []) + [store]  # keep the store alive
        return dist.ProcessGroupGloo(store, self.index, self.world_size, timeout)


class ModelWorkerClient(WorkerClient):
    """The model worker's RPC surface (control calls; engine calls arrive with issue #5)."""
