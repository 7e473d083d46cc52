"""Local scheduler: every worker is a subprocess in its own process group, logging to its file.

Stopping sends SIGTERM to each process group, then SIGKILL after a grace period, so a worker's
own children go too. Each child also asks the kernel (``PR_SET_PDEATHSIG``) to be killed if the
launching process dies without cleaning up, so even ``kill -9`` of launch leaves nothing behind.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import shlex
import signal
import subprocess
import time

from scheduler.base import GroupSpec, JobRequest, JobState, JobStatus, Scheduler
from scheduler.spares import Activation, Spares
from system.errors import SchedulerError

_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def exit_code_state(code: int | None) -> JobState:
    """Map a ``Popen.returncode`` to a :class:`JobState` (negative = killed by that signal)."""
    if code is None:
        return JobState.RUNNING
    if code == 0:
        return JobState.COMPLETED
    if code in (-signal.SIGTERM, -signal.SIGINT):
        return JobState.CANCELLED
    return JobState.FAILED


@dataclasses.dataclass(frozen=True)
class LocalProcess:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    log_path: str


@dataclasses.dataclass(frozen=True)
class LocalRequest(JobRequest):
    group: GroupSpec
    processes: tuple[LocalProcess, ...]

    def materialize(self) -> str:
        return "\n".join(
            f"# {p.name} -> {p.log_path}\n"
            + " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items())
            + " " + shlex.join(p.argv) for p in self.processes)


def _popen(argv: list[str], **kw: object) -> subprocess.Popen:
    """A worker process: its own session (stopped as a group), killed with the launcher."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_child_setup,
                            close_fds=True, **kw)  # type: ignore[call-overload]


class LocalScheduler(Scheduler):
    def __init__(self, spares: bool = True) -> None:
        self._procs: dict[str, tuple[subprocess.Popen, LocalProcess]] = {}
        self._logs: list = []
        self._spares = Spares(_popen) if spares else None

    def plan(self, group: GroupSpec) -> LocalRequest:
        """One process per worker ``first + i``, told its index (``--index`` and
        ``RLSYS_WORKER_INDEX``)."""
        return LocalRequest(group, tuple(
            LocalProcess(name, (*group.argv, "--index", str(group.first + i)),
                         {**group.env, "RLSYS_WORKER_INDEX": str(group.first + i)},
                         group.log_paths[i])
            for i, name in enumerate(group.worker_names())))

    def schedule(self, request: JobRequest) -> list[str]:
        assert isinstance(request, LocalRequest)
        ids = []
        if self._spares is not None:
            self._spares.remember(request.group)
        for w in request.processes:
            if w.name in self._procs:
                raise SchedulerError(f"worker {w.name} was already submitted")
            os.makedirs(os.path.dirname(w.log_path), exist_ok=True)
            proc = self._from_spare(request.group, w) or self._start(w)
            self._procs[w.name] = (proc, w)
            ids.append(str(proc.pid))
        return ids

    def _from_spare(self, group: GroupSpec, w: LocalProcess) -> subprocess.Popen | None:
        if self._spares is None:
            return None
        return self._spares.take(group, Activation(int(w.env["RLSYS_WORKER_INDEX"]), w.env,
                                                   os.path.abspath(w.log_path)))

    def _start(self, w: LocalProcess) -> subprocess.Popen:
        log = open(w.log_path, "ab", buffering=0)
        self._logs.append(log)
        try:
            return _popen(list(w.argv), stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, env={**os.environ, **w.env})
        except OSError as e:
            raise SchedulerError(f"cannot start {w.name}: {e}") from e

    def warm_spares(self) -> None:
        """Keep one warm spare per worker group from now on (:mod:`scheduler.spares`)."""
        if self._spares is not None:
            self._spares.warm()

    def poll(self, fresh: bool = False) -> list[JobStatus]:
        out = []
        for name, (proc, spec) in self._procs.items():
            code = proc.poll()
            detail = "" if code is None else (
                f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}")
            out.append(JobStatus(str(proc.pid), exit_code_state(code), (name,), (spec.log_path,),
                                 detail))
        return out

    def stop_all(self, grace: float) -> None:
        spares = self._spares.processes() if self._spares is not None else []
        _terminate([p for p, _ in self._procs.values()] + spares, grace)
        if self._spares is not None:
            self._spares.forget()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def stop_group(self, kind: str, grace: float) -> None:
        names = [n for n in self._procs if n.split("/")[0] == kind]
        _terminate([self._procs[n][0] for n in names], grace)
        for n in names:
            del self._procs[n]

    def stop_worker(self, name: str, grace: float) -> None:
        """Terminate worker ``name``'s process group (SIGTERM, SIGKILL after ``grace``) and
        forget it; the rest of its group runs on."""
        if name in self._procs:
            _terminate([self._procs[name][0]], grace)
            del self._procs[name]


def _terminate(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM each process group, SIGKILL what is left after ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # SIGKILL every group, even of processes that exited: their children may linger.
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired as e:
            raise SchedulerError(f"process {p.pid} survived SIGKILL") from e


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
