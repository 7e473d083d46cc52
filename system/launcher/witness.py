"""A worker's witness: under Slurm, a small child process of each worker that vouches for it and
can end it.

Slurm reports jobs, not tasks: a job of several workers runs while any of them does. From the
scheduler alone the controller can tell neither whether a silent worker of such a job still runs
(a busy machine: judged late, then hung after ``controller.hang_grace``) or died (judged at
once), nor stop one task of the running step (a hung worker restarted alone would run on beside
its replacement). The witness does both. :mod:`system.launcher.run_worker` forks it before the
worker starts its own threads; it is a process of its own, so a worker that holds the
interpreter lock, or is stopped, cannot starve it:

- it keeps ``alive/KIND/INDEX`` = ``host:pid:nonce`` (:func:`system.names.alive`; the nonce
  tells incarnations apart where pids repeat, in a container's own pid namespace) while its
  parent lives (TTL: :data:`ALIVE_TTLS` heartbeat TTLs), and deletes it as soon as the parent
  has exited (it waits on the parent's pidfd). Slurm kills whatever is left of a step on a node
  once the last task there has exited: a witness killed so (a job of one task per node) cannot
  delete the key, which then ends with its TTL;
- it reads ``stop/KIND/INDEX`` (:func:`system.names.stop_order`) every heartbeat TTL (0.5 to
  10 s). An order that names its own incarnation ends the parent: SIGTERM (with SIGCONT, for a
  stopped process), then SIGKILL once the order's grace has passed. It then deletes the order.

It ignores the signals a job's tasks get (scancel's SIGTERM, preemption's SIGUSR2, a terminal's
SIGINT): it ends with its parent and never holds up that parent's stop. A witness that fails
leaves its worker unvouched, as it would be without one, and says why on stderr (the task's log).
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

from system import names
from system.bootstrap import Bootstrap, read_secret
from system.errors import NameEntryNotFound
from system.launcher.standby import set_process_name
from system.name_resolve import NameResolve, NameResolveConfig, make_name_resolve
from system.thread_stacks import STACKS_SIGNAL

POLL = 0.2
"""Seconds between the witness's looks at its parent where the kernel has no pidfd."""

ALIVE_TTLS = 3
"""The alive key's TTL, in heartbeat TTLs. Its liveness ends with the deletion, at the worker's
death; the TTL bounds how long a witness that could not delete it (lost with its node, killed
with its step) vouches for a dead worker. Refreshed every heartbeat TTL, it costs a third of a
heartbeat's writes."""

IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2, STACKS_SIGNAL)
"""Signals Slurm or a terminal sends to every task's process group: the witness ends with its
parent, whatever they do to it. The stacks signal too: the worker's handler, inherited with
the fork, would write the witness's stack into the worker's log, amid the worker's own."""


@dataclasses.dataclass(frozen=True)
class StopOrder:
    """The controller's order to end one incarnation of a worker (``stop/KIND/INDEX``)."""

    incarnation: str
    """``host:pid:nonce`` of the process to end, as its witness wrote it in
    ``alive/KIND/INDEX``: a later incarnation (a restart) is not touched by an order meant for
    an earlier one."""
    grace: float
    """Seconds between SIGTERM and SIGKILL."""

    def __post_init__(self) -> None:
        if not isinstance(self.incarnation, str) or not self.incarnation:
            raise ValueError(f"incarnation must be a non-empty string, got {self.incarnation!r}")
        if isinstance(self.grace, bool) or not isinstance(self.grace, (int, float)) or not (
                0 <= self.grace < float("inf")):
            raise ValueError(f"grace must be a number of seconds >= 0, got {self.grace!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "StopOrder":
        """The order in ``text``; ValueError if it is not one."""
        data: Any = json.loads(text)
        if not isinstance(data, dict) or set(data) != {"incarnation", "grace"}:
            raise ValueError(f"not a stop order: {text[:200]!r}")
        return StopOrder(data["incarnation"], data["grace"])


def incarnation(pid: int) -> str:
    """``host:pid:nonce``: who a witness vouches for (the nonce: a pid namespace of its own
    gives every incarnation the same pid)."""
    return f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}"


def order_stop(nr: NameResolve, exp: str, trial: str, worker: str, grace: float) -> str | None:
    """Order the witness of ``worker``'s process (``kind/index``), if one vouches for it, to end
    that process; returns the incarnation ordered to stop, None when no witness vouches for a
    process of that worker (none runs, or it is not under Slurm)."""
    kind, index = worker.split("/")
    try:
        target = nr.get(names.alive(exp, trial, kind, int(index)))
    except NameEntryNotFound:
        return None
    order_stop_of(nr, exp, trial, worker, target, grace)
    return target


def order_stop_of(nr: NameResolve, exp: str, trial: str, worker: str, incarnation: str,
                  grace: float) -> None:
    """Order the witness of ``worker``'s process ``incarnation`` (``host:pid:nonce``) to end
    it, should it still run: any other incarnation's witness leaves the order alone."""
    kind, index = worker.split("/")
    nr.add(names.stop_order(exp, trial, kind, int(index)),
           StopOrder(incarnation, grace).to_json(), replace=True)


def start(boot: Bootstrap, kind: str, index: int) -> int:
    """Fork the witness of this process, worker ``kind/index``; returns its pid. Call it before
    the worker starts its own threads (a forked child holds only the forking thread; the
    witness uses nothing that another thread may hold locked)."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for sig in IGNORED:
            signal.signal(sig, signal.SIG_IGN)
        set_process_name(f"witness/{kind}")
        secret = read_secret(os.path.join(boot.trial_dir, "secret"))
        nr = make_name_resolve(NameResolveConfig(**boot.name_resolve), boot.name_resolve_root,
                               secret)
        code = Witness(nr, boot.exp, boot.trial, kind, index, parent, boot.heartbeat_ttl).run()
    except BaseException:  # noqa: BLE001 - said on the task's log; the worker goes on
        print(f"witness of {kind}/{index}: failed; the worker runs unvouched\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
    finally:
        os._exit(code)


class Witness:
    """The witness's loop over an open name resolution (``ttl``: the heartbeat's)."""

    def __init__(self, nr: NameResolve, exp: str, trial: str, kind: str, index: int,
                 parent: int, ttl: float, poll: float = POLL) -> None:
        self.nr = nr
        self.worker = f"{kind}/{index}"
        self.parent = parent
        self.ttl, self.poll = ttl, poll
        self.alive_key = names.alive(exp, trial, kind, index)
        self.order_key = names.stop_order(exp, trial, kind, index)
        self.me = incarnation(parent)
        self.ordered: StopOrder | None = None
        self._order_text: str | None = None  # the order carried out, as read
        self._refused = ""  # the last malformed order said (once)
        self._unreadable = False  # a read failed (said once until one succeeds)
        self._pidfd = _pidfd(parent)  # signals reach this process only, never a reused pid

    def run(self) -> int:
        """Vouch until the parent is gone (ending it if ordered); returns the exit code."""
        if os.getppid() != self.parent:
            return 0  # it died before we started
        self.nr.add(self.alive_key, self.me, replace=True, keepalive_ttl=ALIVE_TTLS * self.ttl)
        every = min(max(self.ttl, 0.5), 10.0)
        next_read, kill_at = 0.0, float("inf")
        try:
            while True:
                now = time.monotonic()
                if self.ordered is None and now >= next_read:
                    next_read = now + every
                    self.ordered = self._order()
                    if self.ordered is not None:
                        self._say(f"ordered to end {self.me}: SIGTERM, SIGKILL in "
                                  f"{self.ordered.grace:.0f}s")
                        self._signal(signal.SIGTERM)
                        self._signal(signal.SIGCONT)  # a stopped process must see it
                        kill_at = now + self.ordered.grace
                if now >= kill_at:
                    self._signal(signal.SIGKILL)
                    kill_at = float("inf")
                due = min(kill_at, next_read if self.ordered is None else float("inf"))
                if self._parent_exited(max(0.0, min(due - time.monotonic(), 60.0))):
                    break
        finally:
            self.nr.release(self.alive_key)  # not refreshed again, whatever is found below
            self._forget(self.alive_key, self.me)
            if self._order_text is not None:
                self._forget(self.order_key, self._order_text)
            self.nr.close()
        return 0

    def _parent_exited(self, wait: float) -> bool:
        """Whether the parent has exited, waiting up to ``wait`` seconds for it."""
        if self._pidfd is None:
            time.sleep(min(wait, self.poll))
            return os.getppid() != self.parent
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(wait * 1000))

    def _forget(self, key: str, value: str) -> None:
        """Delete ``key`` if it still holds ``value`` (not a newer incarnation's)."""
        try:
            if self.nr.get(key) == value:
                self.nr.delete(key)
        except Exception:  # noqa: BLE001 - gone, or the backend is (the alive key expires)
            pass

    def _order(self) -> StopOrder | None:
        """The stop order for this incarnation, if there is one."""
        try:
            text = self.nr.get(self.order_key)
        except NameEntryNotFound:
            self._unreadable = False
            return None
        except Exception as e:  # noqa: BLE001 - a backend outage: read again later
            if not self._unreadable:
                self._say(f"cannot read {self.order_key} (reads again): {type(e).__name__}: {e}")
            self._unreadable = True
            return None
        self._unreadable = False
        try:
            order = StopOrder.from_json(text)
        except ValueError as e:
            if text != self._refused:
                self._refused = text
                self._say(f"ignored a malformed order: {e}")
            return None
        if order.incarnation != self.me:
            return None
        self._order_text = text
        return order

    def _signal(self, sig: signal.Signals) -> None:
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.parent, sig)
        except ProcessLookupError:
            pass  # gone already

    def _say(self, text: str) -> None:
        print(f"witness of {self.worker}: {text}", file=sys.stderr, flush=True)


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (None where the kernel has none: then plain pids are signalled)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
