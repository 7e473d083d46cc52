"""The spare's side of :mod:`scheduler.spares`: warm up, then fork a worker for each activation.

Also names every worker process ``kind/index`` (``/proc/PID/comm``, what ``ps`` and ``top``
show), since a spare's command line cannot say which worker it became; a spare is
``warm/kind`` while it imports and ``spare/kind`` once it is ready (15 bytes at most).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import select
import signal
import sys
import time
from typing import Any, Callable

from scheduler.spares import Activation, Forked
from system.bootstrap import Bootstrap
from system.errors import ConfigError

log = logging.getLogger("standby")

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def set_process_name(name: str) -> None:
    """``/proc/self/comm`` = ``name`` (the kernel keeps 15 bytes)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def warm(imports: Callable[[Bootstrap], None] | None, boot: Bootstrap) -> None:
    """Run the kind's warm-up imports now, on this (the worker's own) thread at its own
    priority: imports made on a lower-priority thread left torch's compute threads at that
    priority (training ran 10x slower). Best effort: an import that fails here fails for real,
    and is reported, where the worker needs it."""
    t0 = time.monotonic()
    if imports is not None:
        try:
            imports(boot)
        except Exception as e:  # noqa: BLE001 - a warm-up only
            log.warning("warm-up failed: %s: %s", type(e).__name__, e)
    log.info("warm in %.1fs; waiting", time.monotonic() - t0)


PREPARE_AFTER_RESTART_S = 60.0
"""After a prepared child became a worker, the spare waits this long before preparing the next
(and a spare that forks the trial's first workers before preparing its first):
the restart it served and the steps after it keep the CPUs (on two cores a vLLM engine built
meanwhile slowed those steps by as much as it had saved). A second failure within that time
gets a fresh fork, which builds its own."""


@dataclasses.dataclass
class _Prepared:
    """A child of the spare that prepares (or prepared) a worker's state ahead of a restart."""

    pid: int
    pidfd: int
    to_child: int  # the activation line goes here
    ready_fd: int  # one byte comes from here once the child has prepared
    ready: bool = False
    ended: bool = False  # ready_fd hit end-of-file: it died before it was ready


def fork_workers(kind: str, prepare: Callable[[], Any] | None = None,
                 prepare_delay: float = PREPARE_AFTER_RESTART_S, serving_start: bool = False
                 ) -> tuple[Activation, Any] | None:
    """The spare's loop: for each activation line on stdin fork a child that becomes that
    worker (this returns its :class:`Activation` in the child, with what ``prepare`` built for
    it or None), answer the child's pid on stdout, and later its exit code (the spare is its
    parent and reaps it). Returns None in the spare when the scheduler went away (end of
    stdin); a malformed line is logged and skipped.

    The spare only imported modules: it runs no threads of its own, so a fork copies a
    quiescent process (torch's and vLLM's pools start in the child, when it first needs them).
    With ``prepare`` (the experiment's, e.g. building a vLLM engine), one child at a time runs
    it ahead of need and waits; an activation goes to it once it is ready (a child that would
    have to fork again from a threaded process is never forked), else to a fresh fork. Each
    preparation starts ``prepare_delay`` seconds after the last was used, the first at once, or
    as late for a spare ``serving_start`` (it forks the trial's first workers: not while they
    start).
    """
    return _Spare(kind, prepare, prepare_delay, prepare_delay if serving_start else 0.0).run()


class _Spare:
    def __init__(self, kind: str, prepare: Callable[[], Any] | None, delay: float,
                 first_delay: float = 0.0) -> None:
        self.kind = kind
        self.prepare = prepare
        self.delay = delay
        self.first_delay = first_delay
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.prep: _Prepared | None = None
        self.pid = os.getpid()
        # answers on their own descriptor: whatever a library prints goes to the log
        self.answers = os.dup(1)
        os.dup2(2, 1)

    def run(self) -> tuple[Activation, Any] | None:
        if self.prepare is not None and (
                child := self._start_prepared(self.first_delay)) is not None:
            return child
        pending = b""
        while True:
            watched = [0, *self.children]
            if self.prep is not None:
                watched += [self.prep.pidfd] + (
                    [] if self.prep.ready or self.prep.ended else [self.prep.ready_fd])
            ready, _, _ = select.select(watched, [], [])
            for fd in ready:
                if fd in self.children:
                    self._reap(fd)
            if self.prep is not None:
                self._watch_prepared(ready)
            if 0 not in ready:
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    act = Activation.parse(line.decode(errors="replace"))
                except ConfigError as e:
                    log.error("not an activation: %s", e)
                    continue
                if act.expired():  # the scheduler started a process for it instead
                    log.warning("activation of worker %d read past its deadline: skipped",
                                act.index)
                    continue
                if (child := self._activate(act, line)) is not None:
                    return child

    def _answer(self, a: Forked) -> None:
        os.write(self.answers, a.line())

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self._answer(Forked(pid, os.waitstatus_to_exitcode(status)))

    def _watch_prepared(self, ready: list[int]) -> None:
        p = self.prep
        assert p is not None
        if not p.ready and p.ready_fd in ready:
            if os.read(p.ready_fd, 1):
                p.ready = True
                log.info("prepared for a restart (pid %d)", p.pid)
            else:
                p.ended = True  # (its pidfd says when it is gone)
        if p.pidfd in ready:  # it died before any restart needed it
            _, status = os.waitpid(p.pid, 0)
            log.warning("preparing for a restart failed (exit code %d): restarts prepare their "
                        "own", os.waitstatus_to_exitcode(status))
            for fd in (p.pidfd, p.to_child, p.ready_fd):
                os.close(fd)
            self.prep, self.prepare = None, None

    def _activate(self, act: Activation, line: bytes) -> tuple[Activation, Any] | None:
        """Hand ``act`` to the prepared child if it is ready, else fork a fresh one."""
        p, lost = self.prep, False
        if p is not None and p.ready:
            self.prep = None
            try:
                os.write(p.to_child, line + b"\n")
            except OSError:  # it died since it said it was ready: a fresh fork instead
                p.ready, lost = False, True
            os.close(p.to_child)
            os.close(p.ready_fd)
            if p.ready:
                self.children[p.pidfd] = p.pid  # reaped (and answered) like any child
                self._answer(Forked(p.pid))
                return self._start_prepared(self.delay)
            os.waitpid(p.pid, 0)  # (never announced: reaped without an answer)
            os.close(p.pidfd)
        pid = self._fork()
        if pid == 0:
            _become(act, self.pid)
            return act, None
        self.children[os.pidfd_open(pid)] = pid
        self._answer(Forked(pid))
        return self._start_prepared(self.delay) if lost else None

    def _fork(self) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # nothing of the spare's bookkeeping stays open in a child
            for fd in [*self.children, self.answers]:
                os.close(fd)
            if self.prep is not None:
                for fd in (self.prep.pidfd, self.prep.to_child, self.prep.ready_fd):
                    os.close(fd)
        return pid

    def _start_prepared(self, delay: float) -> tuple[Activation, Any] | None:
        """Fork the child that prepares; returns in that child once it was activated."""
        if self.prepare is None:
            return None
        r_act, w_act = os.pipe()
        r_ok, w_ok = os.pipe()
        pid = self._fork()
        if pid == 0:
            os.close(w_act)
            os.close(r_ok)
            return self._prepared_child(r_act, w_ok, delay)
        os.close(r_act)
        os.close(w_ok)
        self.prep = _Prepared(pid, os.pidfd_open(pid), w_act, r_ok)
        return None

    def _prepared_child(self, r_act: int, w_ok: int, delay: float) -> tuple[Activation, Any]:
        # its own group from the start: whatever preparing starts is stopped with the worker
        os.setsid()
        _die_with_parent()
        if os.getppid() != self.pid:
            os._exit(1)
        set_process_name(f"prep/{self.kind}")
        time.sleep(delay)
        assert self.prepare is not None
        t0 = time.monotonic()
        try:
            state = self.prepare()
        except Exception:  # noqa: BLE001 - the spare logs it, restarts prepare their own
            log.exception("preparing for a restart failed")
            os._exit(3)
        log.info("prepared in %.1fs; waiting", time.monotonic() - t0)
        os.write(w_ok, b"1")
        os.close(w_ok)
        line = b""
        while not line.endswith(b"\n"):
            data = os.read(r_act, 1 << 16)
            if not data:
                os._exit(0)  # the spare went away
            line += data
        os.close(r_act)
        act = Activation.parse(line.decode(errors="replace"))  # (the spare parsed it)
        _become(act, self.pid)
        return act, state


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _become(act: Activation, spare: int) -> None:
    """In the forked child: lead a session of its own (stopped as a group, like every local
    worker), die with the spare (which dies with the launcher), take the activation's
    environment and log file, read nothing from the spare's stdin."""
    if os.getsid(0) != os.getpid():  # (a prepared child leads its session already)
        os.setsid()
    _die_with_parent()
    if os.getppid() != spare:  # the spare died between the fork and the prctl
        os._exit(1)
    os.environ.update(act.env)
    fd = os.open(act.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
