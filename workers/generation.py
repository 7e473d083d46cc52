"""Generation servers: one per generation replica; serve rollout workers' requests."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from system.errors import ConfigError
from workers.base import Worker
from workers.client import WorkerClient


@dataclasses.dataclass
class GenerationServerConfig:
    """Generation servers (one per replica)."""

    count: int = 2
    """How many generation servers."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ConfigError(f"generation.count must be >= 0, got {self.count}")


class GenerationServer(Worker):
    kind = "generation"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests = 0

    def on_configure(self, config: dict[str, Any]) -> None:
        self.gen_cfg = GenerationServerConfig(**config["worker"])

    def rpc_handlers(self) -> dict[str, Callable[..., Any]]:
        return {**super().rpc_handlers(), "echo": self.echo}

    def echo(self, tokens: np.ndarray) -> dict[str, Any]:
        """Return the tokens with this server's identity: the transport check of the smoke
        experiment, which has no model."""
        self.requests += 1
        return {"tokens": tokens, "server": self.index, "requests": self.requests}

    def report(self) -> dict[str, Any]:
        return {**super().report(), "requests": self.requests}


class GenerationClient(WorkerClient):
    """The generation server's RPC surface."""

    def echo(self, tokens: np.ndarray, timeout: float | None = None) -> dict[str, Any]:
        return self.rpc.call("echo", timeout, tokens=tokens)
