"""What the controller reads from name resolution while it watches a trial.

Each poll reads three things: the workers' error reports, the addresses they are registered at
(a restarted worker registers anew) and which of them still heart-beat. :class:`NameWatch`
holds that reading apart from the controller, so that it can be measured over many simulated
workers (``tests/benchmarks/scale.py``) without a whole trial.
"""
from __future__ import annotations

import dataclasses
from typing import Collection

from system import names
from system.name_resolve import NameResolve


@dataclasses.dataclass(frozen=True)
class WatchView:
    """One poll's reading: ``errors`` ``{key: report}``, ``addresses`` ``{worker: address}``,
    ``beating`` the workers whose heartbeat is alive."""

    errors: dict[str, str]
    addresses: dict[str, str]
    beating: frozenset[str]


class NameWatch:
    """Reads a trial's errors, addresses and heartbeats; workers are named ``kind/index``."""

    def __init__(self, nr: NameResolve, exp: str, trial: str) -> None:
        self.nr = nr
        self._errors = names.worker_errors(exp, trial)
        self._addresses = names.worker_addresses(exp, trial)
        self._heartbeats = names.heartbeats(exp, trial)

    def errors(self) -> dict[str, str]:
        """``{key: report}`` of every error a worker published."""
        return self.nr.get_subtree(self._errors)

    def registered(self) -> dict[str, str]:
        """``{worker: address}`` of every registered worker."""
        n = len(self._addresses) + 1
        return {k[n:]: v for k, v in self.nr.get_subtree(self._addresses).items()}

    def addresses(self, rejoining: Collection[str] = ()) -> dict[str, str]:
        """``{worker: address}``: what the controller compares with the addresses it holds."""
        return self.registered()

    def beating(self, workers: Collection[str]) -> frozenset[str]:
        """Those of ``workers`` whose heartbeat is alive."""
        n = len(self._heartbeats) + 1
        alive = {k[n:] for k in self.nr.find_subtree(self._heartbeats)}
        return frozenset(w for w in workers if w in alive)

    def poll(self, workers: Collection[str], rejoining: Collection[str] = ()) -> WatchView:
        """Everything one iteration of the controller's watch loop reads, in its order."""
        return WatchView(self.errors(), self.addresses(rejoining), self.beating(workers))
