"""The client side of the worker RPC surface: typed calls that return a :class:`Pending`.

Every client method sends its request at once and returns a :class:`Pending` handle, so one call
is ``client.ping().result(timeout)`` and a fan-out over many workers is
``collect([c.ping() for c in clients], timeout)``: every request is on the wire before the first
reply is awaited. Each worker kind has a client class next to its worker class that mirrors the
kind's :meth:`~workers.base.Worker.rpc_handlers` table; no call site names a method by string.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Generic, Sequence, TypeVar, cast

from system.errors import CallAbandoned, NotSent, PeerDied, RpcError, RpcTimeout
from system.rpc import RpcClient
from workers.schema import ConfigureReply, PingReply, WorkerReport, WorkerSetup

T = TypeVar("T")


class Pending(Generic[T]):
    """One request in flight; :meth:`result` waits for its reply (raising what the call
    raised: :class:`~system.errors.RpcTimeout`, :class:`~system.errors.RemoteError`...)."""

    def __init__(self, rpc: RpcClient, method: str, args: dict[str, Any]) -> None:
        self.method = method
        self._rpc = rpc
        self._id = rpc.submit(method, **args)

    @property
    def address(self) -> str:
        """The server's address."""
        return self._rpc.address

    def result(self, timeout: float | None = None) -> T:
        return cast(T, self._rpc.result(self._id, timeout))

    def result_while(self, alive: Callable[[], bool], timeout: float, check_every: float = 2.0
                     ) -> T:
        """The reply, waiting up to ``timeout`` but asking ``alive()`` every ``check_every``
        seconds meanwhile: a server found dead fails the call at once
        (:class:`~system.errors.PeerDied`) instead of after the whole timeout."""
        return self._wait(timeout, check_every, lambda: None if alive() else PeerDied(
            f"{self.method} to {self._rpc.address}: the server died while serving it"))

    def result_unless(self, stopping: Callable[[], bool], timeout: float | None,
                      check_every: float = 0.5) -> T:
        """The reply, waiting up to ``timeout`` (None: the client's) but no longer once
        ``stopping()`` says the caller itself was asked to stop: the call is then abandoned
        (:class:`~system.errors.CallAbandoned`). So a stop ends the wait within
        ``check_every`` even where no reply will come (a peer stopped before it read the
        request)."""
        return self._wait(self._rpc.timeout if timeout is None else timeout, check_every,
                          lambda: CallAbandoned(f"{self.method} to {self._rpc.address}: "
                                                "abandoned, the caller is stopping")
                          if stopping() else None)

    def _wait(self, timeout: float, check_every: float,
              give_up: Callable[[], RpcError | None]) -> T:
        """The reply within ``timeout``, asking ``give_up()`` every ``check_every`` seconds
        meanwhile; an error it returns abandons the call and is raised."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            last = left <= check_every
            try:
                return cast(T, self._rpc.result(self._id, max(0.0, min(check_every, left)),
                                                abandon=last))
            except NotSent:  # no reply can come: not worth the rest of the wait
                raise
            except RpcTimeout:
                if last:
                    raise
                error = give_up()
                if error is not None:
                    self._rpc.abandon(self._id)
                    raise error from None


def _result(p: Pending[T], timeout: float | None, deadline: float | None,
            stopping: Callable[[], bool] | None) -> T:
    """``p``'s reply by the fan-out's ``deadline`` (``timeout`` after it began)."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return p.result(left) if stopping is None else p.result_unless(stopping, left)
    except RpcTimeout as e:
        if timeout is None or isinstance(e, NotSent):
            raise
        # (said as the fan-out's timeout, not as what was left of it)
        raise RpcTimeout(f"no reply from {p.address} within {timeout:.1f}s") from None


def collect(pending: Sequence[Pending[T]], timeout: float | None = None,
            stopping: Callable[[], bool] | None = None) -> list[T]:
    """Every reply, in order; the first failure raises (after the earlier replies arrived).
    ``timeout`` is the whole fan-out's (its requests went out together: a peer that never
    answers costs it once, not once per such peer); None: each client's own. ``stopping``:
    see :meth:`Pending.result_unless`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return [_result(p, timeout, deadline, stopping) for p in pending]


def collect_settled(pending: Sequence[Pending[T]], timeout: float | None = None,
                    stopping: Callable[[], bool] | None = None) -> list[T | RpcError]:
    """Every reply, or the :class:`RpcError` its call raised (the caller decides what a failure
    means). ``timeout`` and ``stopping``: see :func:`collect`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out: list[T | RpcError] = []
    for p in pending:
        try:
            out.append(_result(p, timeout, deadline, stopping))
        except RpcError as e:
            out.append(e)
    return out


class WorkerClient:
    """Control calls every worker serves (mirrors :meth:`workers.base.Worker.rpc_handlers`)."""

    def __init__(self, rpc: RpcClient, name: str) -> None:
        self.rpc = rpc
        self.name = name

    @property
    def kind(self) -> str:
        return self.name.split("/")[0]

    def _call(self, method: str, **args: Any) -> Pending[Any]:
        return Pending(self.rpc, method, args)

    def configure(self, setup: WorkerSetup) -> Pending[ConfigureReply]:
        return self._call("configure", config=setup)

    def start(self) -> Pending[None]:
        return self._call("start")

    def stop(self) -> Pending[None]:
        return self._call("stop")

    def ping(self) -> Pending[PingReply]:
        return self._call("ping")

    def report(self) -> Pending[WorkerReport]:
        return self._call("report")

    def close(self) -> None:
        self.rpc.close()
