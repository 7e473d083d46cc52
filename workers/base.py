"""The worker base: register, heartbeat, serve control RPCs, run a role, report.

A worker process (``python -m system.launcher.run_worker``) builds one :class:`Worker` subclass
per kind and calls :meth:`Worker.run` with the role the experiment gives that kind. The RPC
server runs in a thread; the main thread waits for ``start``, runs the role, and then waits for
``stop``. An exception in the role is written (with its traceback text) under the worker's error
key for the controller, and the process exits non-zero. What a role hands to its worker (engines,
a task source, an HTTP endpoint) goes through typed methods of the kind's class.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, ClassVar

from scheduler.slurm_marks import REQUEUE_MARK_ENV
from system import names
from system.bootstrap import Bootstrap, bind_host, read_secret
from system.errors import ConfigError, FdExhausted, NameEntryNotFound, first_line
from system.limits import FdWatch, raise_fd_limit
from system.name_resolve import NameResolveConfig, make_name_resolve
from system.rpc import RpcClient, RpcConfig, RpcServer
from system.signal_relay import SignalRelay
from system.thread_stacks import thread_stacks
from workers import preempt_wait
from workers.orphan_clock import OrphanClock
from workers.schema import ConfigureReply, PingReply, WorkerReport, WorkerSetup

log = logging.getLogger("worker")

SIGNAL_CUT = 5.0
"""Seconds a worker stopped by SIGTERM or SIGINT gives what it has in flight (a rollout worker's
episodes) before it cuts it short: Slurm's ``KillWait`` (30 s by default) follows SIGTERM."""

STOP_NAMES_WAIT = 3.0
"""Seconds a stopping worker waits for a name service that does not answer (per call)."""


class WorkerState(str, enum.Enum):
    CREATED = "created"
    CONFIGURED = "configured"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPING = "stopping"


class Worker:
    """Base of every worker kind. Subclasses set :attr:`kind` and may add RPC handlers in
    :meth:`rpc_handlers` (an explicit table, mirrored by the kind's client class)."""

    kind: ClassVar[str] = ""
    cuts_in_flight: ClassVar[bool] = False
    """Whether a signal's stop sets :attr:`stop_by` by what Slurm leaves the job (a rollout
    worker's episodes; an ``scontrol`` look, not asked of the other kinds)."""

    def __init__(self, boot: Bootstrap, index: int, local_rank: int = 0) -> None:
        self.boot = boot
        self.index = index
        self.local_rank = local_rank
        self.exp, self.trial = boot.exp, boot.trial
        self.rpc_cfg = RpcConfig(**boot.rpc)
        secret = read_secret(os.path.join(boot.trial_dir, "secret"))
        self.fd_limit = raise_fd_limit()  # (soft, hard): every connection to us costs one
        self.codec = self.rpc_cfg.codec(secret)
        self.name_resolve = make_name_resolve(NameResolveConfig(**boot.name_resolve),
                                              boot.name_resolve_root, secret)
        self.host = bind_host(boot.interface, boot.scheduler)
        self.server = RpcServer(self.codec, self.host, self.rpc_handlers())
        self.state = WorkerState.CREATED
        self.config: WorkerSetup = {"worker": {}, "experiment": {}, "counts": {}, "recover": "off"}
        self.result: dict[str, Any] = {}
        self.started_at = time.time()
        self._start = threading.Event()
        self._stop = threading.Event()
        self._serve_stop = threading.Event()
        self.signalled: str | None = None  # the signal that stopped us, if any
        self.stop_by: float | None = None
        """``time.monotonic()`` by which a worker stopped by a signal cuts short what it has in
        flight (its job ends soon after); None: no such limit."""
        self.orphaned = False  # stopped because the controller's liveness key expired
        self._alive_before: dict[str, set[int]] = {}  # kind -> alive at the last read
        self._served: dict[tuple[str, int], str] = {}  # (kind, index) -> address last read
        self.prepared: Any = None
        """What a warm spare built for this worker ahead of its restart (the experiment's
        ``prepare``; None: nothing), for the role to use or drop."""

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.index}"

    # --- the explicit RPC surface (see WorkerClient) ---
    def rpc_handlers(self) -> dict[str, Callable[..., Any]]:
        return {"configure": self.configure, "start": self.start, "stop": self.stop,
                "ping": self.ping, "report": self.report}

    def configure(self, config: WorkerSetup) -> ConfigureReply:
        """Returns this worker's incarnation (its job's restart count), so the controller can
        tell a worker it already configured from one that is yet to rejoin."""
        if self.state not in (WorkerState.CREATED, WorkerState.CONFIGURED):
            raise RuntimeError(f"cannot configure a worker in state {self.state.value}")
        self.config = config
        self.on_configure(config)
        self.state = WorkerState.CONFIGURED
        return {"restart": int(os.environ.get("SLURM_RESTART_COUNT", 0))}

    def start(self) -> None:
        if self.state != WorkerState.CONFIGURED:
            raise RuntimeError(f"cannot start a worker in state {self.state.value}")
        self.state = WorkerState.RUNNING
        self._start.set()

    def stop(self) -> None:
        self._stop.set()
        # what is left to do (the role's unwinding, removing our keys) does not wait out a
        # name service that does not answer, calls retrying already included
        self.name_resolve.stopping(STOP_NAMES_WAIT)
        if self.state not in (WorkerState.COMPLETED, WorkerState.FAILED):
            self.state = WorkerState.STOPPING

    def ping(self) -> PingReply:
        return {"kind": self.kind, "index": self.index, "local_rank": self.local_rank,
                "state": self.state.value, "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
                "pid": os.getpid(), "host": socket.gethostname(),
                "uptime": time.time() - self.started_at, "drops": self.server.drops.as_dict(),
                "served": self.server.served, "unsent": self.server.unsent,
                "progress": self.progress()}

    def report(self) -> WorkerReport:
        """What this worker did (the role's result and its counters)."""
        return {"kind": self.kind, "index": self.index, "state": self.state.value,
                "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
                "result": self.result, "drops": self.server.drops.as_dict()}

    # --- hooks for subclasses and roles ---
    def on_configure(self, config: WorkerSetup) -> None:
        """Kind-specific configuration (validate and keep what the role will need)."""

    def progress(self) -> dict[str, Any]:
        return {}

    def on_preempt(self) -> bool:
        """Called on SIGUSR2 (Slurm's warning before the time limit or preemption), in the
        thread that handles signals: return True to stop later (the worker then calls
        :meth:`stop` itself once its state is safe in a checkpoint), False to stop gracefully
        at once."""
        return False

    def stop_after_checkpoint(self, timeout: float | None = None) -> bool:
        """:meth:`on_preempt` of a worker that holds training state: ask the master for a
        checkpoint now and stop once it is committed, or after ``timeout`` seconds (None: what
        Slurm leaves before it ends the job, :mod:`workers.preempt_wait`). Returns True (the
        stop comes later)."""
        preempt_wait.stop_after_checkpoint(self, timeout)
        return True

    def _on_signal(self, signum: signal.Signals) -> None:
        """SIGTERM, SIGINT (stop gracefully) or SIGUSR2 (a preemption's or time limit's
        warning), in the relay's thread (see :mod:`system.signal_relay`: this takes locks).
        One during the controller's stop (the scheduler's SIGTERM after the grace, a time
        limit's warning as the trial ends) leaves it the controller's: exit 0, no requeue."""
        if self.stopping and self.signalled is None:
            log.warning("%s got %s while stopping as the controller asked", self.name, signum.name)
            return
        if signum == signal.SIGTERM and not self.stopping and self._preempting():
            log.warning("%s got SIGTERM with its job chosen for preemption: as SIGUSR2 (a "
                        "checkpoint where state is held, then the job's requeue)", self.name)
            signum = signal.SIGUSR2
        self.signalled = signum.name
        if signum == signal.SIGUSR2:
            self._requeue_if_preempted()  # now: the controller reads it as "stopping for a requeue"
            try:
                if self.on_preempt():
                    log.warning("%s got SIGUSR2: stopping once the state is checkpointed",
                                self.name)
                    return
            except Exception:
                log.exception("on_preempt failed")
            if self.cuts_in_flight:
                preempt_wait.cut_in_flight(self)
        else:
            preempt_wait.tighten(self, time.monotonic() + SIGNAL_CUT)
        log.warning("%s got %s: stopping", self.name, self.signalled)
        self.stop()

    def _preempting(self) -> bool:
        """Whether this worker's Slurm job, which may be requeued, is being preempted: a
        preemption with a grace time sends SIGTERM to the tasks (not the job's ``--signal``).
        Not asked of a worker the controller already stops (its stop ends in SIGTERM)."""
        job = os.environ.get("SLURM_JOB_ID")
        if not job or not os.environ.get(REQUEUE_MARK_ENV):
            return False
        from scheduler.slurm_jobs import preempting  # (Slurm's commands: under Slurm only)

        try:
            return preempting(job)
        except Exception:  # noqa: BLE001 - the SIGTERM must stop the worker whatever happens
            log.exception("could not ask whether job %s is preempted", job)
            return False

    def _requeue_if_preempted(self) -> None:
        """On SIGUSR2 under Slurm with requeue on, ask for a requeue of the job: create the file
        its batch script checks once srun has returned (it then runs ``scontrol requeue``; the
        workers rejoin the trial, and the controller configures and starts them again). Made at
        the signal, so that the controller, seeing the heartbeat expire while the worker stops,
        waits for the requeue instead of judging the worker dead."""
        mark = os.environ.get(REQUEUE_MARK_ENV)
        if self.signalled != "SIGUSR2" or not mark:
            return
        try:
            with open(mark, "a"):
                pass
            log.warning("requeue of job %s requested (%s)", os.environ.get("SLURM_JOB_ID"), mark)
        except OSError as e:
            log.error("could not request the requeue of job %s: %s",
                      os.environ.get("SLURM_JOB_ID"), e)

    def _report_failure(self, e: BaseException, tb: str) -> None:
        """Publish the role's exception under the trial's ``error`` key (the controller names
        it in the failure; ``config``: a configuration error, which a restart cannot mend)."""
        try:
            self.name_resolve.add(
                names.worker_error(self.exp, self.trial, self.kind, self.index),
                json.dumps({"type": type(e).__name__, "message": str(e), "traceback": tb,
                            "config": isinstance(e, ConfigError)}),
                replace=True)
        except Exception as report_error:  # (its cause, in one line: often the same as e's)
            log.error("could not report the failure: %s", first_line(report_error))

    def _watch_controller(self, period: float) -> None:
        """Stop this worker, as SIGTERM would, once its controller is judged dead from its
        liveness key (:class:`~workers.orphan_clock.OrphanClock` says when)."""
        key = names.controller(self.exp, self.trial)
        clock = OrphanClock(self.boot.orphan_timeout, self.name_resolve.outage_timeout,
                            time.monotonic())
        while not self._serve_stop.wait(period):
            found: bool | None = True
            try:
                self.name_resolve.get(key)
            except NameEntryNotFound:
                found = False
            except Exception as e:  # a backend hiccup is no news, not a dead controller (yet)
                log.warning("cannot read the controller's liveness key: %s", e)
                found = None
            why = clock.read(time.monotonic(), found)
            if why is not None:
                self._stop_orphaned(why)
                return

    def _stop_orphaned(self, why: str) -> None:
        log.warning("%s: %s: the controller is dead, stopping", self.name, why)
        self.orphaned = True
        self.stop()
        # A role stuck where it never looks at `stopping` (a collective whose peers are gone)
        # would keep the process and its GPUs forever: nobody is left to kill it.
        if not self._serve_stop.wait(max(self.boot.orphan_timeout, 10.0)):
            log.error("%s did not stop within %.0fs of losing its controller: exiting; its "
                      "threads:\n%s", self.name, max(self.boot.orphan_timeout, 10.0),
                      thread_stacks())
            logging.shutdown()
            os._exit(3)

    def _watch_fds(self, serve: threading.Thread, period: float = 0.25) -> None:
        """Warn when file descriptors run short; fail the worker, saying why, once none has
        been free for a few seconds (a flood of connections): it could not refresh its
        heartbeat, open a file or accept a call, and would otherwise just go silent."""
        watch = FdWatch()
        warned = 0.0
        while not self._serve_stop.wait(period):
            state = watch.check()
            if state == "low" and time.monotonic() - warned > 60:
                warned = time.monotonic()
                log.warning("%s: file descriptors running out (%s)", self.name, watch.detail)
            elif state == "exhausted":
                self._fail_out_of_fds(watch.detail, serve)
                return

    def fail_now(self, e: Exception) -> None:
        """End this process at once, from any thread, reporting ``e`` (the controller names
        it; a ConfigError is not recovered): for a role stuck where no exception reaches it
        (a user's reward function that never returns)."""
        log.error("%s failed: %s", self.name, e)
        self.state = WorkerState.FAILED
        self._report_failure(e, "")
        logging.shutdown()
        os._exit(1)

    def _fail_out_of_fds(self, detail: str, serve: threading.Thread) -> None:
        message = (f"{self.name} ran out of file descriptors ({detail}; a flood of "
                   f"connections to {self.server.address}?): stopping")
        log.error(message)
        self.state = WorkerState.FAILED
        self._serve_stop.set()
        serve.join(timeout=1)  # quickly: the heartbeat has not been refreshed since
        self.server.close()  # closes every connection to it: descriptors to report with
        time.sleep(0.2)
        self._report_failure(FdExhausted(message), "")
        logging.shutdown()
        os._exit(4)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait_stop(self, timeout: float | None = None) -> bool:
        return self._stop.wait(timeout)

    def client(self, address: str, timeout: float | None = None) -> RpcClient:
        return RpcClient(self.codec, address, timeout or self.rpc_cfg.request_timeout)

    def peers(self, kind: str | None = None) -> dict[str, str]:
        """``{"kind/index": address}`` of registered workers (optionally of one kind)."""
        prefix = names.worker_addresses(self.exp, self.trial, kind)
        root = names.worker_addresses(self.exp, self.trial) + "/"
        return {k[len(root):]: v for k, v in self.name_resolve.get_subtree(prefix).items()}

    def alive(self, kind: str) -> set[int]:
        """Indices of the workers of ``kind`` whose heartbeat key is alive. For one heartbeat
        TTL after name resolution answered again from an outage (a restarted Redis server may
        have lost every key; their owners add them back within that time) those alive before it
        count too."""
        prefix = names.heartbeats(self.exp, self.trial, kind) + "/"
        found = {int(k[len(prefix):]) for k in self.name_resolve.find_subtree(prefix[:-1])
                 if k[len(prefix):].isdigit()}
        if self.names_just_back():
            return found | self._alive_before.get(kind, set())
        self._alive_before[kind] = found
        return found

    def names_just_back(self) -> bool:
        """Name resolution was seen down (or back from it) less than a heartbeat TTL ago."""
        return self.name_resolve.outage_within(self.boot.heartbeat_ttl)

    def serving_at(self, kind: str, index: int) -> str | None:
        """The address worker ``kind/index`` is registered at while it heart-beats (None: dead
        or gone). A restarted worker registers anew: compare with the address a client holds.
        Just after a name-resolution outage an address not yet added back is the one last
        read."""
        if index not in self.alive(kind):
            return None
        try:
            address = self.name_resolve.get(names.worker_address(self.exp, self.trial, kind,
                                                                 index))
        except NameEntryNotFound:
            return self._served.get((kind, index)) if self.names_just_back() else None
        self._served[(kind, index)] = address
        return address

    # --- lifecycle ---
    def run(self, role: Callable[[Any], dict[str, Any] | None]) -> int:
        """The process body: register, serve, run ``role(self)`` once started; returns the exit
        code."""
        SignalRelay((signal.SIGTERM, signal.SIGINT, signal.SIGUSR2), self._on_signal).install()
        nr = self.name_resolve
        # host:pid:nonce: a replacement's never equals it (another node's, or another pid
        # namespace's process of the same pid), so a stale refresh tells it from its own
        beat = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        nr.add(names.heartbeat(self.exp, self.trial, self.kind, self.index), beat,
               replace=True, keepalive_ttl=self.boot.heartbeat_ttl)
        serve = threading.Thread(target=self.server.serve_forever, args=(self._serve_stop,),
                                 name="rpc-server", daemon=True)
        serve.start()
        nr.add(names.worker_address(self.exp, self.trial, self.kind, self.index),
               self.server.address, replace=True)
        log.info("%s registered at %s", self.name, self.server.address)
        threading.Thread(target=self._watch_controller, name="controller-watch", daemon=True,
                         args=(min(max(self.boot.orphan_timeout / 10, 0.1), 5.0),)).start()
        threading.Thread(target=self._watch_fds, name="fd-watch", daemon=True,
                         args=(serve,)).start()
        code = 0
        try:
            while not self._start.wait(0.1):
                if self._stop.is_set():
                    return self._exit_code(0)
            self.result = role(self) or {}
            if self.state == WorkerState.RUNNING:
                self.state = WorkerState.COMPLETED
            log.info("%s role finished: %s", self.name, _short(self.result))
            while not self._stop.wait(0.5):
                pass
        except (Exception, SystemExit) as e:  # (sys.exit in a role's code: a failure too)
            if not self._stop.is_set():
                tb = traceback.format_exc()
                log.error("%s failed:\n%s", self.name, tb)
                if self.signalled is None:  # (stopped by a signal: the job's fate tells)
                    self._report_failure(e, tb)
            else:  # a stop interrupted the role (the master's "stopped during training")
                log.warning("%s stopped%s while its role ran (%s: %s)", self.name,
                            f" by {self.signalled}" * bool(self.signalled), type(e).__name__,
                            first_line(e))
                if self.signalled in (None, "SIGUSR2"):  # (SIGUSR2: a stop for a requeue,
                    return self._exit_code(0)  # after the checkpoint; else the code tells)
            code, self.state = 1, WorkerState.FAILED
        finally:
            self._serve_stop.set()
            serve.join(timeout=5)
            self.server.close()
            # Stopped by the controller: remove our keys. Stopped by a signal (scancel,
            # requeue, preemption): stop refreshing and let the heartbeat expire, so the
            # controller sees the job's fate before it sees a dead worker.
            if self.signalled is None:  # (if still ours: a replacement may hold them now)
                for key, value in ((names.heartbeat(self.exp, self.trial, self.kind,
                                                    self.index), beat),
                                   (names.worker_address(self.exp, self.trial, self.kind,
                                                         self.index), self.server.address)):
                    try:
                        if nr.get(key) == value:
                            nr.delete(key)
                    except Exception:
                        pass
            nr.close()
        return self._exit_code(code)

    def _exit_code(self, code: int) -> int:
        """``code``, or ``128 + N`` (the shell's convention) when signal ``N`` (SIGTERM,
        SIGINT: not the controller's stop, nor a preemption's SIGUSR2) stopped this worker:
        its job then reads as stopped by that signal, not as completed."""
        if code in (0, 1) and self.signalled in ("SIGTERM", "SIGINT"):  # (1: what stopping
            # interrupted raised, e.g. the master's "stopped during training")
            return 128 + signal.Signals[self.signalled].value
        return code


def _short(obj: Any, n: int = 300) -> str:
    s = repr(obj)
    return s if len(s) <= n else s[:n] + "..."
