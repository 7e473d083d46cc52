"""Typed client side of the worker RPC surface shared by every kind."""
from __future__ import annotations

from typing import Any, Sequence

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
