"""Local scheduler: every worker is a subprocess in its own process group, logging to its file.

Stopping sends SIGTERM to each process group, then SIGKILL after a grace period, so a worker's
own children go too. Each child also asks the kernel (``PR_SET_PDEATHSIG``) to be killed if the
launching process dies without cleaning up, so even ``kill -9`` of launch leaves nothing behind.

GPU placement: with GPUs (``scheduler.local.gpus``, see :func:`local_gpus`) every worker gets
its own as its ``CUDA_VISIBLE_DEVICES`` (:func:`~scheduler.gpu_plan.plan_gpus`, decided for the
whole trial at construction, so a restarted worker gets its devices again); without, the
environment is left as it is.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Collection, Mapping, Sequence

from scheduler.base import GroupSpec, JobRequest, JobState, JobStatus, Scheduler
from scheduler.cpu_plan import cpu_env, cpus_env
from scheduler.gpu_plan import GpuDemand, parse_visible, plan_gpus
from scheduler.spares import Activation, ForkedWorker, Spares
from system.errors import SchedulerError
from system.thread_stacks import STACKS_SIGNAL, ask_for_stacks

_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:  # runs in the child between fork and exec
    # the launcher blocks SIGURG for its stacks thread; a worker sets its own listener up, and
    # until then takes none (python -m system.ctl stacks names it as still starting)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACKS_SIGNAL})
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


STOPPED_BY = {128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGINT: "SIGINT"}
"""Exit codes of a worker that a signal stopped gracefully (``128 + N``, the shell's way)."""


def exit_code_state(code: int | None) -> JobState:
    """Map a ``Popen.returncode`` to a :class:`JobState` (negative = killed by that signal)."""
    if code is None:
        return JobState.RUNNING
    if code == 0:
        return JobState.COMPLETED
    if code in (-signal.SIGTERM, -signal.SIGINT, *STOPPED_BY):
        return JobState.CANCELLED
    return JobState.FAILED


def failed_by_itself(code: int | None) -> bool:
    """Whether a worker that exited with ``code`` failed by itself: an error exit or a crash
    (a fatal signal of its own), not a stop or a kill from outside (SIGTERM, SIGKILL, SIGINT,
    SIGHUP: the scheduler, a user, the out-of-memory killer)."""
    return exit_code_state(code) is JobState.FAILED and code not in (-signal.SIGKILL,
                                                                     -signal.SIGHUP)


def exit_detail(code: int) -> str:
    """How an ended process ended, in words."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code in STOPPED_BY:
        return f"stopped by {STOPPED_BY[code]} (exit code {code})"
    return f"exit code {code}"


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


@dataclasses.dataclass(frozen=True)
class LocalGpus:
    """The GPUs the local workers share out: ``ids`` (empty: none), whether the workers' GPU
    environment is set at all (``managed``: not on a machine without GPUs left on auto), and
    extra variables every worker gets (the device order the ids were listed in)."""

    ids: tuple[str, ...] = ()
    managed: bool = False
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


def local_gpus(setting: str, environ: Mapping[str, str]) -> LocalGpus:
    """What ``scheduler.local.gpus`` means here: ``none``; device ids; or ``auto``: the
    launcher's ``CUDA_VISIBLE_DEVICES`` if set, else what ``nvidia-smi`` lists (indices in PCI
    order, so the workers get ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless an order is set), else
    none, the environment untouched (a CPU machine)."""
    if setting == "none":
        return LocalGpus((), True)
    if setting != "auto":
        return LocalGpus(parse_visible(setting), True)
    if "CUDA_VISIBLE_DEVICES" in environ:
        return LocalGpus(parse_visible(environ["CUDA_VISIBLE_DEVICES"]), True)
    ids = _nvidia_smi_indices()
    if not ids:
        return LocalGpus()
    order = {} if "CUDA_DEVICE_ORDER" in environ else {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    return LocalGpus(ids, True, order)


def _nvidia_smi_indices() -> tuple[str, ...]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        r = subprocess.run([exe, "--query-gpu=index", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(line.strip() for line in r.stdout.splitlines() if line.strip().isdigit()) \
        if r.returncode == 0 else ()


Process = subprocess.Popen | ForkedWorker
"""A local worker: a process the scheduler started, or one a warm spare forked."""


def _popen(argv: list[str], **kw: object) -> subprocess.Popen:
    """A worker process: its own session (stopped as a group), killed with the launcher."""
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_child_setup,
                            close_fds=True, **kw)  # type: ignore[call-overload]


class LocalScheduler(Scheduler):
    def __init__(self, gpus: LocalGpus = LocalGpus(), demands: Sequence[GpuDemand] = (),
                 share_gpus: bool = False, spares: bool = True,
                 cpus: Mapping[str, tuple[int, ...]] | None = None,
                 spare_kinds: Collection[str] | None = None) -> None:
        """``gpus``: what the workers share out; ``demands``: every GPU-using group of the
        trial. Too few GPUs for them is a :class:`~scheduler.gpu_plan.GpuPlanError` here,
        before anything starts, unless ``share_gpus`` (no GPUs at all: every worker on the
        CPU). ``spares``: keep warm spares for the groups that use no GPU, once asked
        (:meth:`warm_spares`), of the kinds ``spare_kinds`` (None: every kind). ``cpus``:
        each bound worker's CPU set (:func:`~scheduler.cpu_plan.plan_cpus`), given to it as
        ``RLSYS_CPUS``."""
        self._cpus = dict(cpus or {})
        self._procs: dict[str, tuple[Process, LocalProcess]] = {}
        self._logs: list = []
        self._gpus = gpus
        self._placement = plan_gpus(gpus.ids, demands, share_gpus) if gpus.ids else {}
        self._spares = Spares(_popen) if spares else None
        self._spare_kinds = None if spare_kinds is None else frozenset(spare_kinds)
        # > 0: the trial is starting, its workers forked from spares (from warm_spares with a
        # start_wait until warm_spares() again, once it runs)
        self._start_wait = 0.0
        self._unspared: set[str] = set()  # kinds whose forked workers failed during the start

    def devices(self, name: str) -> tuple[str, ...]:
        """The GPU ids worker ``name`` sees (none: not a GPU worker, or no GPUs here)."""
        return self._placement.get(name, ())

    def cpus(self, name: str) -> tuple[int, ...]:
        """The CPUs worker ``name`` is bound to (none: unbound)."""
        return self._cpus.get(name, ())

    def _gpu_env(self, name: str) -> dict[str, str]:
        if not self._gpus.managed:
            return {}
        return {**self._gpus.env, "CUDA_VISIBLE_DEVICES": ",".join(self.devices(name))}

    def plan(self, group: GroupSpec) -> LocalRequest:
        """One process per worker ``first + i``, told its index (``--index`` and
        ``RLSYS_WORKER_INDEX``) and, with GPUs, its devices (``CUDA_VISIBLE_DEVICES``)."""
        return LocalRequest(group, tuple(
            LocalProcess(name, (*group.argv, "--index", str(group.first + i)),
                         {**group.env, "RLSYS_WORKER_INDEX": str(group.first + i),
                          **self._gpu_env(name), **cpu_env(self._cpus, name)},
                         group.log_paths[i])
            for i, name in enumerate(group.worker_names())))

    def submit_all(self, groups: Sequence[GroupSpec],
                   waiting: Callable[[], None] | None = None) -> dict[str, list[str]]:
        """Start every group; with spares asked for before (:meth:`warm_spares` with a
        ``start_wait``), every group's spare starts first, all at once, and each group is
        started once its spare has made its imports: its workers are forked from it. A group
        without a spare starts at once; ``waiting`` is called every 0.05 s meanwhile."""
        requests = self.plan_all(groups)
        if self._spares is None or self._start_wait <= 0:  # (> 0: warm_spares turned them on)
            return {r.group.kind: self.schedule(r) for r in requests}
        for r in requests:
            self._remember(r)
        self._spares.warm(serving_start=True)
        ids: dict[int, list[str]] = {}
        deadline = time.monotonic() + self._start_wait
        while len(ids) < len(requests):
            late = time.monotonic() > deadline  # (a process each for what is not ready)
            for i, r in enumerate(requests):
                if i not in ids and (late or not self._spares.warming(r.group)):
                    ids[i] = self.schedule(r)
            if len(ids) < len(requests):
                if waiting is not None:
                    waiting()
                time.sleep(0.05)
        return {r.group.kind: ids[i] for i, r in enumerate(requests)}

    def _remember(self, request: JobRequest) -> None:
        """Let ``request``'s group have a spare, if its kind gets one and it uses no GPU (a
        spare cannot take a worker's GPUs: CUDA fixes them when it first initialises). A spare
        runs on its group's CPUs; each worker it forks moves onto its own."""
        assert isinstance(request, LocalRequest)
        if self._spares is None or request.group.kind in self._unspared or (
                self._spare_kinds is not None and request.group.kind
                not in self._spare_kinds) or any(
                self.devices(w.name) for w in request.processes):
            return
        group_cpus = {c for w in request.processes for c in self.cpus(w.name)}
        self._spares.remember(request.group, {**self._gpu_env(request.processes[0].name),
                                              **cpus_env(group_cpus)})

    def schedule(self, request: JobRequest) -> list[str]:
        assert isinstance(request, LocalRequest)
        ids = []
        self._remember(request)
        for w in request.processes:
            if w.name in self._procs:
                raise SchedulerError(f"worker {w.name} was already submitted")
            os.makedirs(os.path.dirname(w.log_path), exist_ok=True)
            proc = self._from_spare(request.group, w) or self._start(w)
            self._procs[w.name] = (proc, w)
            ids.append(str(proc.pid))
        return ids

    def _from_spare(self, group: GroupSpec, w: LocalProcess) -> ForkedWorker | None:
        if self._spares is None or group.kind in self._unspared:
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

    def warm_spares(self, start_wait: float = 0.0) -> None:
        """Keep one warm spare per worker group from now on (:mod:`scheduler.spares`). Asked
        before the trial's workers are submitted, with ``start_wait`` > 0, the spares fork
        those workers too (:meth:`submit_all`): each kind's imports are made once, by its
        spare, instead of by every worker and again by the spare beside the trial's start-up,
        and the first restart finds its spare ready. A group whose spare died, or has not made
        its imports within ``start_wait`` seconds, gets processes of its own instead."""
        if self._spares is not None:
            self._start_wait = start_wait
            self._spares.warm()

    def poll(self, fresh: bool = False) -> list[JobStatus]:
        if self._spares is not None:
            self._spares.tidy()
            for pid in self._spares.late_kills:
                print(f"a retired warm spare forked a worker late (pid {pid}): killed; the "
                      "process started instead runs that worker", file=sys.stderr)
            self._spares.late_kills.clear()
        out = []
        for name, (proc, spec) in self._procs.items():
            code = proc.poll()
            detail = "" if code is None else exit_detail(code)
            out.append(JobStatus(str(proc.pid), exit_code_state(code), (name,), (spec.log_path,),
                                 detail))
        return out

    def stop_all(self, grace: float) -> None:
        # the workers first: a forked worker dies with its spare, without its grace period
        try:
            _terminate([p for p, _ in self._procs.values()], grace)
        finally:
            if self._spares is not None:
                _terminate(list(self._spares.processes()), grace)
                self._spares.forget()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def stop_group(self, kind: str, grace: float) -> None:
        """Terminate every worker of ``kind`` and forget them. While the trial starts, a
        group one of whose workers forked from its spare failed by itself, none of them
        killed from outside, is started as processes from then on (:func:`failed_by_itself`;
        a fault that shows only in a forked copy, such as state a warm module set up that does
        not survive a fork, would otherwise fail every attempt of the start)."""
        names = [n for n in self._procs if n.split("/")[0] == kind]
        codes = {n: self._procs[n][0].poll() for n in names} if self._start_wait > 0 else {}
        failed = [(n, c) for n, c in codes.items()
                  if isinstance(self._procs[n][0], ForkedWorker) and failed_by_itself(c)]
        if any(c not in (None, 0) and not failed_by_itself(c) for c in codes.values()):
            failed = []  # one was killed from outside: its peers' errors may follow from it
        _terminate([self._procs[n][0] for n in names], grace)
        for n in names:
            del self._procs[n]
        if failed and self._spares is not None and kind not in self._unspared:
            self._unspared.add(kind)
            self._spares.drop_kind(kind)
            name, code = failed[0]
            print(f"{name}, forked from its group's warm spare, failed while the trial started "
                  f"({exit_detail(code)}): {kind} workers start as new processes from now on",
                  file=sys.stderr)

    def dump_stacks(self, workers: Collection[str]) -> list[str]:
        """SIGURG to each live worker process of ``workers`` that handles it, not to its
        process group."""
        return [str(p.pid) for w in workers if w in self._procs
                for p in [self._procs[w][0]] if p.poll() is None and ask_for_stacks(p.pid)]

    def stop_worker(self, name: str, grace: float) -> None:
        """Terminate worker ``name``'s process group (SIGTERM, SIGKILL after ``grace``) and
        forget it; the rest of its group runs on."""
        if name in self._procs:
            _terminate([self._procs[name][0]], grace)
            del self._procs[name]


def _terminate(procs: list[Process], grace: float) -> None:
    """SIGTERM each process group, SIGKILL what is left after ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGTERM, p)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # SIGKILL every group, even of processes that exited: their children may linger.
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL, p)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired as e:
            raise SchedulerError(f"process {p.pid} survived SIGKILL") from e


def _signal_group(pgid: int, sig: int, proc: Process | None = None) -> None:
    """``sig`` to process group ``pgid``; to ``proc`` itself when it leads no group yet (a
    worker a spare just forked, before its ``setsid``) and is still ours (not reaped)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    except PermissionError:
        pass
