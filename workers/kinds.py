"""The registry of worker kinds: name -> worker class and client class, in start order (master
last)."""
from __future__ import annotations

from system.rpc import RpcClient
from workers.base import Worker
from workers.client import WorkerClient
from workers.generation import GenerationClient, GenerationServer
from workers.master import MasterClient, MasterWorker
from workers.model import ModelWorker
from workers.model_client import ModelClient
from workers.rollout import RolloutClient, RolloutWorker

KINDS: dict[str, type[Worker]] = {
    "model": ModelWorker,
    "generation": GenerationServer,
    "rollout": RolloutWorker,
    "master": MasterWorker,
}


def worker_class(kind: str) -> type[Worker]:
    if kind not in KINDS:
        raise KeyError(f"unknown worker kind {kind!r}; valid: {sorted(KINDS)}")
    return KINDS[kind]


CLIENTS: dict[str, type[WorkerClient]] = {
    "model": ModelClient,
    "generation": GenerationClient,
    "rollout": RolloutClient,
    "master": MasterClient,
}


def client_for(name: str, rpc: RpcClient) -> WorkerClient:
    """The typed client of worker ``name`` (``kind/index``)."""
    return CLIENTS[name.split("/")[0]](rpc, name)
