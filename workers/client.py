"""Typed client side of the worker RPC surface shared by every kind."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from system.errors import RpcError
from system.rpc import RpcClient


class WorkerClient:
    """Control calls every worker serves (mirrors :meth:`workers.base.Worker.rpc_handlers`)."""

    def __init__(self, rpc: RpcClient, name: str) -> None:
        self.rpc = rpc
        self.name = name

    def configure(self, config: dict[str, Any], timeout: float | None = None) -> None:
        self.rpc.call("configure", timeout, config=config)

    def start(self, timeout: float | None = None) -> None:
        self.rpc.call("start", timeout)

    def pause(self, timeout: float | None = None) -> None:
        self.rpc.call("pause", timeout)

    def resume(self, timeout: float | None = None) -> None:
        self.rpc.call("resume", timeout)

    def stop(self, timeout: float | None = None) -> None:
        self.rpc.call("stop", timeout)

    def ping(self, timeout: float | None = None) -> dict[str, Any]:
        return self.rpc.call("ping", timeout)

    def report(self, timeout: float | None = None) -> dict[str, Any]:
        return self.rpc.call("report", timeout)

    def close(self) -> None:
        self.rpc.close()


def gather(clients: Sequence[WorkerClient], method: str, timeout: float,
           args: Sequence[dict[str, Any]] | None = None) -> list[Any]:
    """Call ``method`` on every client at once; each entry is the result or the
    :class:`RpcError` it raised (the caller decides what a failure means)."""
    ids = [c.rpc.submit(method, **(args[i] if args else {})) for i, c in enumerate(clients)]
    out: list[Any] = []
    for c, rid in zip(clients, ids):
        try:
            out.append(c.rpc.result(rid, timeout))
        except RpcError as e:
            out.append(e)
    return out


class PeerClients:
    """Clients of the trial's other workers, kept current as workers register again (a
    requeued job's workers come back at new addresses)."""

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
            self._clients[name] = WorkerClient(self._connect(address), name)
            self._addresses[name] = address

    def all(self) -> list[WorkerClient]:
        return [self._clients[n] for n in sorted(self._clients)]

    def of_kind(self, *kinds: str) -> list[WorkerClient]:
        return [c for c in self.all() if c.name.split("/")[0] in kinds]

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        self._addresses.clear()
