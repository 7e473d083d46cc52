"""Warm spares of the local scheduler: one forking spare per worker group.

A restart used to pay a fresh Python's imports before the worker could do anything: about 4 s
for torch and transformers (master, model workers), 8 s for vLLM (generation servers) on two
cores, most of a stateful recovery. A spare is a process started ahead of need with
``--standby``: it imports what its kind will need (the experiment's ``warm`` modules), then
waits on its stdin. Starting a worker of that kind later writes one JSON line to the spare (the
worker index, its environment and its log file: :class:`Activation`); the spare forks, and the
child becomes that worker (:meth:`Spares.take`) with every module already imported, while the
spare goes on waiting for the next restart. So a spare is never used up: no replacement pays
those imports again while the trial runs (on two cores they slowed the steps after every
restart by seconds).

The spare answers on its stdout, one JSON line each (:class:`Forked`): the pid it forked, and
later that pid's exit code (it is the worker's parent and reaps it). The scheduler watches a
forked worker through :class:`ForkedWorker`, which reads those lines. A forked worker leads its
own session (stopped as a group, like every local worker) and is killed with its spare
(``PR_SET_PDEATHSIG``), which is killed with the launcher: ``kill -9`` of the launcher still
leaves nothing behind. Killing a spare therefore kills the workers it forked (they restart).

Spares start only when asked (:meth:`Spares.warm`). The controller asks before it submits the
trial's workers, and the local scheduler then starts every group's spare first and forks the
group's workers from it once it has made its imports: each kind imports once (not once per
worker, and again in a spare beside the trial's start-up), and the first restart finds its
spare ready. At a restart a spare still importing is not used (a new process is started, as
without spares), nor is a dead one (it is started again). One that does not
answer a fork in time is retired and a new process runs that worker. An activation carries its
deadline, and a spare that reads one past it skips it. A copy forked late all the same is killed
(:meth:`Spares.tidy`). The workers a retired spare forked before live on, and it is stopped once
they have all ended (or with the trial).

A group one of whose forked workers fails by itself while the trial starts gets no spare from
then on (:meth:`Spares.drop_kind`, called by the local scheduler's ``stop_group``): a fault that
only a forked copy shows would otherwise fail every attempt of the start.

Under Slurm every worker runs in its own job and a restart is a requeue: there are no spares.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import time
from typing import IO, Any, Callable, Optional

from scheduler.base import GroupSpec
from system.errors import ConfigError

STANDBY_FLAG = "--standby"
SERVES_START_ENV = "RLSYS_SPARE_SERVES_START"
"""Set (``1``) for a spare started before the trial's workers, which it forks: it prepares
nothing ahead (:data:`~system.launcher.standby.PREPARE_AFTER_RESTART_S`) while they start."""


@dataclasses.dataclass(frozen=True)
class Activation:
    """What a spare becomes: worker ``index`` with ``env`` added, logging to ``log``; a spare
    that reads it after ``deadline`` (``time.monotonic()``, one clock for every process of the
    machine) skips it: the scheduler has given up on it and started a process instead."""

    index: int
    env: dict[str, str]
    log: str
    deadline: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ConfigError(f"activation index must be an int >= 0, got {self.index!r}")
        if not isinstance(self.env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ConfigError("activation env must map str to str")
        if not isinstance(self.log, str) or not os.path.isabs(self.log):
            raise ConfigError(f"activation log must be an absolute path, got {self.log!r}")
        if self.deadline is not None and (not isinstance(self.deadline, (int, float))
                                          or isinstance(self.deadline, bool)):
            raise ConfigError(f"activation deadline must be a number, got {self.deadline!r}")

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def line(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self)) + "\n").encode()

    @classmethod
    def parse(cls, line: str) -> "Activation":
        try:
            raw: Any = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"activation is not JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) - {"deadline"} != {"index", "env", "log"}:
            raise ConfigError("activation must have exactly index, env and log (and a deadline)")
        return cls(raw["index"], raw["env"], raw["log"], raw.get("deadline"))


@dataclasses.dataclass(frozen=True)
class Forked:
    """A spare's answer: it forked worker ``pid`` (``code`` None), or its worker ``pid`` exited
    with ``code`` (negative: killed by that signal, as ``Popen.returncode``)."""

    pid: int
    code: Optional[int] = None

    def __post_init__(self) -> None:
        for name, v in (("pid", self.pid), ("code", self.code)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(f"forked {name} must be an int, got {v!r}")
        if self.pid <= 0:
            raise ConfigError(f"forked pid must be > 0, got {self.pid}")

    def line(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self)) + "\n").encode()

    @classmethod
    def parse(cls, line: str) -> "Forked":
        try:
            raw: Any = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"spare answer is not JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) != {"pid", "code"}:
            raise ConfigError("spare answer must have exactly pid and code")
        return cls(raw["pid"], raw["code"])


class _Spare:
    """One forking spare process and what it said on its stdout."""

    def __init__(self, proc: subprocess.Popen, log: IO[bytes]) -> None:
        self.proc = proc
        self.log = log
        self.forked: list[int] = []
        self.exits: dict[int, int] = {}
        self.live: set[int] = set()  # the workers it forked that have not ended
        self._buf = b""
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)

    def pump(self) -> None:
        """Read what the spare wrote so far (never blocks)."""
        assert self.proc.stdout is not None
        try:
            while data := os.read(self.proc.stdout.fileno(), 1 << 16):
                self._buf += data
        except (BlockingIOError, OSError, ValueError):
            pass
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            try:
                a = Forked.parse(line.decode(errors="replace"))
            except ConfigError:
                continue  # (only the spare writes there)
            if a.code is None:
                self.forked.append(a.pid)
                self.live.add(a.pid)
            else:
                self.exits[a.pid] = a.code
                self.live.discard(a.pid)

    def fork(self, activation: Activation, timeout: float) -> Optional[int]:
        """Have the spare fork ``activation``'s worker; its pid, or None (dead, or no answer)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(activation.line())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump()
            if self.forked:
                return self.forked.pop(0)
            if self.proc.poll() is not None:
                return None
            try:  # (poll, not select: the launcher's descriptors may be past 1024)
                waiter = select.poll()
                waiter.register(self.proc.stdout.fileno(), select.POLLIN)
                waiter.poll(100)
            except (OSError, ValueError):
                return None
        self.pump()  # (an answer that came with the last wait)
        return self.forked.pop(0) if self.forked else None

    def alive(self) -> bool:
        return self.proc.poll() is None


class ForkedWorker:
    """A worker a spare forked, watched like a ``Popen`` (``pid``, ``poll``, ``wait``,
    ``returncode``): its exit code comes from its spare, which reaps it."""

    def __init__(self, spare: _Spare, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self.args = f"worker forked by spare {spare.proc.pid}"
        self._spare = spare

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._spare.pump()
            if self.pid in self._spare.exits:
                self.returncode = self._spare.exits.pop(self.pid)
            elif not self._spare.alive() and not _running(self.pid):
                # while the spare lives its answer decides (it reaps the worker); a spare that
                # died took its workers with it (PR_SET_PDEATHSIG), their codes unsaid
                self._spare.pump()
                self.returncode = self._spare.exits.pop(self.pid, -signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code


class Spares:
    """At most one forking spare per worker group command line (a group's ``argv``)."""

    def __init__(self, start: Callable[..., subprocess.Popen]) -> None:
        self._start = start  # Popen with the scheduler's child set-up (new session, death signal)
        self._groups: dict[tuple[str, ...], GroupSpec] = {}
        self._spares: dict[tuple[str, ...], _Spare] = {}
        # alive, did not answer a fork: stopped once its workers have ended (see tidy)
        self._retired: list[_Spare] = []
        self.late_kills: list[int] = []  # (reported by the scheduler's poll)
        self.enabled = False
        self.serving_start = False

    def remember(self, group: GroupSpec, env: dict[str, str] | None = None) -> None:
        """``group``'s workers may restart: once spares are on, keep one of its kind ready
        (started with ``env`` added, as every worker of the group)."""
        if env:
            group = dataclasses.replace(group, env={**group.env, **env})
        self._groups.setdefault(tuple(group.argv), group)

    def warm(self, serving_start: bool = False) -> None:
        """Turn spares on: start one for every group seen that has none alive
        (``serving_start``: to fork the trial's first workers, see :data:`SERVES_START_ENV`;
        so is one started again meanwhile, until the next call without it)."""
        self.enabled = True
        self.serving_start = serving_start
        for key, group in self._groups.items():
            spare = self._spares.get(key)
            if spare is not None and not spare.alive():
                self._drop(key)
                spare = None
            if spare is None:
                self._spawn(key, group)

    def warming(self, group: GroupSpec) -> bool:
        """Whether ``group`` has a live spare that is still making its imports."""
        spare = self._spares.get(tuple(group.argv))
        return spare is not None and spare.alive() and not _ready(spare.proc.pid)

    def take(self, group: GroupSpec, activation: Activation, timeout: float = 10.0
             ) -> ForkedWorker | None:
        """Have ``group``'s spare fork the worker ``activation`` names and return it, or None
        when there is no ready spare (a dead one is started again)."""
        self.tidy()
        key = tuple(group.argv)
        spare = self._spares.get(key)
        if spare is None:
            return None
        if not spare.alive():
            self._drop(key)
            if self.enabled:
                self._spawn(key, group)
            return None
        if not _ready(spare.proc.pid):
            return None  # still importing: no faster than a new process
        activation = dataclasses.replace(activation, deadline=time.monotonic() + timeout)
        pid = spare.fork(activation, timeout)
        if pid is None:
            if spare.alive():  # slow to answer: its workers live on; it stops with the trial
                self._retired.append(self._spares.pop(key))
            else:
                self._drop(key)
            if self.enabled:
                self._spawn(key, group)
            return None
        return ForkedWorker(spare, pid)

    def tidy(self) -> list[int]:
        """Kill the workers that retired spares forked after they were given up on (a spare
        that read the activation just before its deadline and answered after it): a second
        copy of a worker that a new process already runs. Each answer a retired spare gives is
        such a late one (it is never asked again). Stop a retired spare once every worker it
        forked has ended. Returns the pids killed, also kept in ``late_kills``; called at every
        poll and restart."""
        killed = []
        for spare in list(self._retired):
            spare.pump()
            while spare.forked:
                pid = spare.forked.pop(0)
                if pid not in spare.exits and _kill_child(pid, spare.proc.pid):
                    killed.append(pid)
            if not spare.live - set(spare.exits):
                self._retired.remove(spare)
                _reap(spare.proc)  # (its prepared child, if any, goes with it)
                _close(spare)
        self.late_kills += killed
        return killed

    def drop_kind(self, kind: str) -> None:
        """No spare for ``kind`` from now on: its groups are forgotten and its spare retired
        (stopped once the workers it forked have ended, see :meth:`tidy`)."""
        for key in [k for k, g in self._groups.items() if g.kind == kind]:
            del self._groups[key]
            if key in self._spares:
                self._retired.append(self._spares.pop(key))
        self.tidy()

    def processes(self) -> list[subprocess.Popen]:
        return [s.proc for s in [*self._spares.values(), *self._retired]]

    def forget(self) -> None:
        """After :meth:`processes` were stopped."""
        for s in [*self._spares.values(), *self._retired]:
            _close(s)
        self._spares.clear()
        self._retired.clear()
        self.enabled = False

    def _drop(self, key: tuple[str, ...]) -> None:
        spare = self._spares.pop(key)
        _reap(spare.proc)
        _close(spare)

    def _spawn(self, key: tuple[str, ...], group: GroupSpec) -> None:
        log_path = os.path.join(os.path.dirname(group.log_paths[0]), f"spare-{group.kind}.log")
        env = {**os.environ, **group.env}
        env.pop(SERVES_START_ENV, None)
        if self.serving_start:
            env[SERVES_START_ENV] = "1"
        try:
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            log = open(log_path, "ab", buffering=0)
        except OSError:
            return  # no spare: its workers start as new processes, as without spares
        try:
            proc = self._start([*key, STANDBY_FLAG], stdout=subprocess.PIPE, stderr=log,
                               stdin=subprocess.PIPE, env=env)
        except OSError:
            log.close()
            return
        self._spares[key] = _Spare(proc, log)


def _ready(pid: int) -> bool:
    """Whether the spare finished its warm-up (it renames itself ``spare/KIND`` then)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith("spare/")
    except OSError:
        return False


def _kill_child(pid: int, parent: int) -> bool:
    """SIGKILL ``pid`` (its process group once it leads one) if it is still ``parent``'s child
    (unreaped, so its pid is not reused); whether it was."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                return False
    except (OSError, IndexError, ValueError):
        return False
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
            return True
        except OSError:
            continue
    return False


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _close(spare: _Spare) -> None:
    """Close what the launcher holds of ``spare``: its pipes and its log."""
    for f in (spare.proc.stdin, spare.proc.stdout, spare.log):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass
