"""The controller's rejoin of restarted workers when one of several that came back at once fails
its configure or start call: the others still rejoin (they were left waiting for their deadline,
their new address taken for a known one, and failed as 'did not rejoin' after it).

The controller's own ``_rejoin`` runs against its real requeue bookkeeping; the name service,
the RPC clients and the calls' results are stand-ins (the calls themselves are the RPC tests')."""
from __future__ import annotations

import types
from typing import Any

import pytest

import system.launcher.restarts as restarts_module
from scheduler.requeue import RequeuePolicy
from system.errors import RpcTimeout, WorkerFailure
from system.launcher.controller import Controller

BACK = {"generation/0": "tcp://h:1", "generation/1": "tcp://h:2"}


class _Client:
    def __init__(self, name: str, fail_start: set[str], calls: list[str]) -> None:
        self.name, self._fail, self._calls = name, fail_start, calls

    def start(self) -> Any:
        self._calls.append(f"start {self.name}")
        return RpcTimeout(f"start of {self.name}") if self.name in self._fail else None

    def close(self) -> None:
        self._calls.append(f"close {self.name}")


def _controller(monkeypatch, fail_configure: set[str], fail_start: set[str]
                ) -> tuple[Controller, list[str]]:
    calls: list[str] = []
    ctl = object.__new__(Controller)
    ctl.requeue = RequeuePolicy()
    ctl.requeue.respawned(BACK, 120)
    ctl.addresses, ctl.clients = {}, {}
    ctl.logs = {w: f"/logs/{w.replace('/', '-')}.log" for w in BACK}
    ctl.cfg = types.SimpleNamespace(rpc=types.SimpleNamespace(request_timeout=1.0))
    ctl.codec = None
    ctl.names = types.SimpleNamespace(addresses=lambda workers, rejoining: dict(BACK))
    ctl.scheduler = types.SimpleNamespace(poll=lambda: [])  # (no job waits in the queue)
    running: list[list[str]] = []
    ctl.recovery = types.SimpleNamespace(running=running.append)
    ctl._recover_requeued_state = lambda: None
    ctl._requeued = lambda worker: False
    ctl._ended_job = lambda phase, failed: failed

    def configure_all(clients: list[_Client]) -> None:
        for c in clients:
            calls.append(f"configure {c.name}")
        for c in clients:
            if c.name in fail_configure:
                fail_configure.discard(c.name)  # (once: its restart would register anew)
                raise WorkerFailure(f"configure of worker {c.name} failed", c.name)
    ctl._configure_all = configure_all
    monkeypatch.setattr(restarts_module, "RpcClient", lambda *a, **k: None)
    monkeypatch.setattr(restarts_module, "client_for",
                        lambda name, rpc: _Client(name, fail_start, calls))
    monkeypatch.setattr(restarts_module, "collect_settled",
                        lambda pending, timeout=None: list(pending))
    ctl.running_calls = running  # type: ignore[attr-defined]
    return ctl, calls


def test_the_others_are_configured_again_when_one_fails_its_configure(monkeypatch):
    ctl, calls = _controller(monkeypatch, {"generation/0"}, set())
    with pytest.raises(WorkerFailure, match="generation/0"):
        ctl._rejoin()
    assert set(ctl.requeue.rejoining) == set(BACK) and ctl.addresses == ctl.clients == {}
    assert calls[-2:] == ["close generation/0", "close generation/1"]
    calls.clear()
    ctl._rejoin()  # (configured again, the failed one too: here its configure passes)
    assert calls == ["configure generation/0", "configure generation/1",
                     "start generation/0", "start generation/1"]
    assert ctl.requeue.rejoining == {} and ctl.addresses == BACK


def test_the_others_have_rejoined_when_one_fails_its_start(monkeypatch):
    ctl, calls = _controller(monkeypatch, set(), {"generation/0"})
    with pytest.raises(WorkerFailure, match="start of worker generation/0 failed"):
        ctl._rejoin()
    assert calls[-3:] == ["start generation/0", "start generation/1", "close generation/0"]
    assert list(ctl.requeue.rejoining) == ["generation/0"]  # its recovery's to restart
    assert ctl.running_calls == [["generation/1"]]  # type: ignore[attr-defined]
    assert ctl.addresses == {"generation/1": "tcp://h:2"} and list(ctl.clients) == [
        "generation/1"]


def test_every_worker_whose_start_failed_is_taken_up_again(monkeypatch):
    """The first failure is raised; a second one that failed too is not left to its deadline
    with its address taken for a known one (nor is one whose job was requeued meanwhile)."""
    ctl, calls = _controller(monkeypatch, set(), {"generation/0", "generation/1"})
    with pytest.raises(WorkerFailure, match="start of worker generation/0 failed"):
        ctl._rejoin()
    assert set(ctl.requeue.rejoining) == set(BACK) and ctl.addresses == ctl.clients == {}
    assert ctl.running_calls == [[]]  # type: ignore[attr-defined]
    ctl._requeued = lambda worker: True  # (a requeued one's failed call is not raised)
    ctl._rejoin()
    assert set(ctl.requeue.rejoining) == set(BACK) and ctl.addresses == ctl.clients == {}
