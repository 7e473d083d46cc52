"""Typed clients of a trial's other workers, kept current as workers register again (a requeued
job's workers come back at new addresses)."""
from __future__ import annotations

from typing import Callable, TypeVar, cast

from system.rpc import RpcClient
from workers.client import WorkerClient
from workers.generation import GenerationClient
from workers.kinds import client_for
from workers.model_client import ModelClient

C = TypeVar("C", bound=WorkerClient)


class PeerClients:
    def __init__(self, lookup: Callable[[], dict[str, str]], connect: Callable[[str], RpcClient],
                 exclude: str = "") -> None:
        self._lookup = lookup
        self._connect = connect
        self._exclude = exclude
        self._clients: dict[str, WorkerClient] = {}
        self._addresses: dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        for name, address in self._lookup().items():
            if name == self._exclude or self._addresses.get(name) == address:
                continue
            old = self._clients.pop(name, None)
            if old is not None:
                old.close()
            self._clients[name] = client_for(name, self._connect(address))
            self._addresses[name] = address

    def address(self, name: str) -> str | None:
        """The address ``name`` was last seen registered at."""
        return self._addresses.get(name)

    def all(self) -> list[WorkerClient]:
        return [self._clients[n] for n in sorted(self._clients, key=_order)]

    def of_kind(self, *kinds: str) -> list[WorkerClient]:
        return [c for c in self.all() if c.kind in kinds]

    def models(self) -> list[ModelClient]:
        return cast(list[ModelClient], self.of_kind("model"))

    def generation_servers(self) -> list[GenerationClient]:
        return cast(list[GenerationClient], self.of_kind("generation"))

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        self._addresses.clear()


def _order(name: str) -> tuple[str, int]:
    """``kind/index`` sorted by kind, then by index as a number (model/10 after model/9)."""
    kind, _, index = name.partition("/")
    return kind, int(index) if index.isdigit() else -1
