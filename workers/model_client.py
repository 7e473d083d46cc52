"""The model worker's typed RPC client (the master's side of :mod:`workers.model`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from system.reshard.spec import WeightSyncSpec
from workers.client import Pending, WorkerClient
from workers.schema import EngineInfo, Saved, TrainItem, TrainStats, WeightsSent

if TYPE_CHECKING:
    import numpy as np


class ModelClient(WorkerClient):
    """The model worker's RPC surface. Every data-parallel rank must receive the same sequence
    of collective calls: call them on all model workers together."""

    def logprobs(self, seqs: "list[np.ndarray]", which: str = "actor",
                 temps: "list[np.ndarray] | None" = None) -> "Pending[list[np.ndarray]]":
        """Per-token log-probs under ``which``; ``temps``: per sequence, the sampling
        temperatures of its completion tokens (empty: 1; None: every sequence at 1)."""
        if temps is None:
            return self._call("logprobs", seqs=seqs, which=which)
        return self._call("logprobs", seqs=seqs, which=which, temps=temps)

    def values(self, seqs: "list[np.ndarray]") -> "Pending[list[np.ndarray]]":
        return self._call("values", seqs=seqs)

    def train_actor(self, batch: list[TrainItem], global_tokens: int, loss: dict[str, Any]
                    ) -> Pending[TrainStats]:
        return self._call("train_actor", batch=batch, global_tokens=global_tokens, loss=loss)

    def train_critic(self, batch: list[TrainItem], global_tokens: int, value_clip: float
                     ) -> Pending[TrainStats]:
        return self._call("train_critic", batch=batch, global_tokens=global_tokens,
                          value_clip=value_clip)

    def weight_sync_init(self, spec: WeightSyncSpec, group: str, replica: int
                         ) -> Pending[dict[str, Any]]:
        return self._call("weight_sync_init", spec=spec.to_wire(), group=group, replica=replica)

    def send_weights(self, replicas: list[int]) -> Pending[WeightsSent]:
        return self._call("send_weights", replicas=list(replicas))

    def save(self, directory: str) -> Pending[Saved]:
        return self._call("save", directory=directory)

    def save_weights(self, directory: str) -> Pending[dict[str, Any]]:
        return self._call("save_weights", directory=directory)

    def ready(self) -> Pending[bool]:
        return self._call("ready")

    def engine_info(self) -> Pending[EngineInfo]:
        return self._call("engine_info")
