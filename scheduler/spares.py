"""Warm spare processes for the local scheduler.

A restart used to pay a fresh Python's imports before the worker could do anything: about 4 s
for torch and transformers (master, model workers), 8 s for vLLM (generation servers) on two
cores, most of a stateful recovery. A spare is a worker process started ahead of need with
``--standby``: it imports what its kind will need (the experiment's ``warm`` modules), then
waits on its stdin. Starting a worker of that kind later hands the spare its identity instead
of starting a new process (:meth:`Spares.take`): one JSON line with the worker index, its
environment and its log file (:class:`Activation`); the spare then registers like any worker.
A used spare is replaced at once (its imports cost a few CPU-seconds while the trial runs); one
still importing is not used (a restart then starts a new process, as without spares). A spare whose launcher goes away reads end-of-file and exits
(and the kernel kills it with the launcher, as every local worker).

Spares start only when asked (:meth:`Spares.warm`: the controller asks once the trial runs), so
they never slow the trial's own start-up. Under Slurm every worker runs in its own job and a
restart is a requeue: there are no spares there.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from typing import IO, Any, Callable

from scheduler.base import GroupSpec
from system.errors import ConfigError

STANDBY_FLAG = "--standby"


@dataclasses.dataclass(frozen=True)
class Activation:
    """What a spare becomes: worker ``index`` with ``env`` added, logging to ``log``."""

    index: int
    env: dict[str, str]
    log: str

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ConfigError(f"activation index must be an int >= 0, got {self.index!r}")
        if not isinstance(self.env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ConfigError("activation env must map str to str")
        if not isinstance(self.log, str) or not os.path.isabs(self.log):
            raise ConfigError(f"activation log must be an absolute path, got {self.log!r}")

    def line(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self)) + "\n").encode()

    @classmethod
    def parse(cls, line: str) -> "Activation":
        try:
            raw: Any = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"activation is not JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) != {"index", "env", "log"}:
            raise ConfigError("activation must have exactly index, env and log")
        return cls(raw["index"], raw["env"], raw["log"])


@dataclasses.dataclass
class _Spare:
    proc: subprocess.Popen
    log: IO[bytes]


class Spares:
    """At most one warm spare per worker group command line (a group's ``argv``)."""

    def __init__(self, start: Callable[..., subprocess.Popen]) -> None:
        self._start = start  # Popen with the scheduler's child set-up (new session, death signal)
        self._groups: dict[tuple[str, ...], GroupSpec] = {}
        self._spares: dict[tuple[str, ...], _Spare] = {}
        self.enabled = False

    def remember(self, group: GroupSpec, env: dict[str, str] | None = None) -> None:
        """``group``'s workers may restart: once spares are on, keep one of its kind ready
        (started with ``env`` added, as every worker of the group)."""
        if env:
            group = dataclasses.replace(group, env={**group.env, **env})
        self._groups.setdefault(tuple(group.argv), group)

    def warm(self) -> None:
        """Turn spares on: start one for every group seen that has none alive."""
        self.enabled = True
        for key, group in self._groups.items():
            spare = self._spares.get(key)
            if spare is None or spare.proc.poll() is not None:
                self._spawn(key, group)

    def take(self, group: GroupSpec, activation: Activation) -> subprocess.Popen | None:
        """Hand ``activation`` to ``group``'s spare and return its process (a replacement
        starts at once), or None when there is no live spare."""
        key = tuple(group.argv)
        spare = self._spares.pop(key, None)
        if spare is None:
            return None
        spare.log.close()
        try:
            if spare.proc.poll() is not None or not _ready(spare.proc.pid):
                raise BrokenPipeError  # dead, or still importing
            assert spare.proc.stdin is not None
            spare.proc.stdin.write(activation.line())
            spare.proc.stdin.close()
        except (BrokenPipeError, OSError):
            _reap(spare.proc)
            return None
        if self.enabled:
            self._spawn(key, group)
        return spare.proc

    def processes(self) -> list[subprocess.Popen]:
        return [s.proc for s in self._spares.values()]

    def forget(self) -> None:
        """After :meth:`processes` were stopped."""
        for s in self._spares.values():
            s.log.close()
        self._spares.clear()
        self.enabled = False

    def _spawn(self, key: tuple[str, ...], group: GroupSpec) -> None:
        log_path = os.path.join(os.path.dirname(group.log_paths[0]), f"spare-{group.kind}.log")
        log = open(log_path, "ab", buffering=0)
        try:
            proc = self._start([*key, STANDBY_FLAG], stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.PIPE, env={**os.environ, **group.env})
        except OSError:
            log.close()
            return  # no spare: a restart starts a new process, as without spares
        self._spares[key] = _Spare(proc, log)


def _ready(pid: int) -> bool:
    """Whether the spare finished its warm-up (it renames itself ``spare/KIND`` then)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith("spare/")
    except OSError:
        return False


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass
