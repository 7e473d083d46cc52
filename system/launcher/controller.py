"""The controller: submit worker groups, wait for registration, configure, start, watch, stop.

It treats every worker the same way: a job from the scheduler, an address and a heartbeat in
name resolution, and an RPC client. The trial completes only when the master reports completion.
A worker that dies, stops heart-beating or reports an exception fails the trial, unless it holds
training state and ``recover=auto``: then the stateful workers restart from the latest checkpoint
(:mod:`system.launcher.restarts`, policy in :mod:`system.launcher.recovery`) while the
others stay up. In every case every job is stopped before :meth:`Controller.run` returns.
"""
from __future__ import annotations

import logging
import signal
import sys
import time
from typing import Any, Iterable

from experiments.registry import Experiment
from scheduler.base import JobState, JobStatus, Scheduler
from scheduler.requeue import Restart
from system import names
from system.errors import (NameServiceRefused, NameServiceUnavailable, RLSystemError, RpcError,
                           SchedulerError, WorkerFailure)
from system.launcher.config import ExperimentConfig
from system.launcher.disk import full_disk_cause
from system.launcher.eval_mode import leftover_logs
from system.launcher.failures import call_failure_cause, job_failure, reported_failure, root_cause
from system.launcher.groups import group_specs, worker_configs
from system.launcher.name_claim import claim_problem, controller_record
from system.launcher.progress import Progress
from system.launcher.queue_wait import StartClock, blocked_failure
from system.launcher.pause_watch import PauseWatch
from system.launcher.recovery import MasterProgress, Recovery
from system.launcher.restarts import RecoveringController
from system.launcher.self_requeue import ControllerRequeue, cancelled_since
from system.launcher.status_file import StatusWriter, TrialCancelled
from system.launcher.summary import TrialSummary
from system.launcher.watch import LateBeats, NameWatch, shared, vouched
from system.name_resolve import NameResolve
from system.paths import TrialPaths
from system.rpc import RpcClient
from system.wire import Codec
from workers.client import WorkerClient, collect_settled
from workers.kinds import KINDS, client_for

log = logging.getLogger("controller")

REPORT_GRACE = 1.0  # for a worker whose heartbeat expired to say why (out of descriptors, say)
NAMES_CLEANUP_WAIT = 3.0  # for a name service that does not answer while the trial stops
CAUSE_GRACE = 3.0  # for the scheduler to show a job ended when its worker refused a call
SPARE_START_WAIT = 300.0  # at most, for a group's warm spare's imports at the start (local)


class Controller(RecoveringController):
    def __init__(self, cfg: ExperimentConfig, experiment: Experiment, paths: TrialPaths,
                 scheduler: Scheduler, name_resolve: NameResolve, codec: Codec) -> None:
        self.cfg = cfg
        self.experiment = experiment
        self.paths = paths
        self.scheduler = scheduler
        self.nr = name_resolve
        self.codec = codec
        self.groups = group_specs(cfg, paths, scheduler.python)
        self.logs = {name: g.log_paths[i] for g in self.groups.values()
                     for i, name in enumerate(g.worker_names())}
        self.clients: dict[str, WorkerClient] = {}
        self.addresses: dict[str, str] = {}
        self.incarnations: dict[str, tuple[str, int]] = {}
        """Worker -> ``host:pid:nonce`` of the process configured (under Slurm: its witness's
        record) and its job's restart count then; ordered to end when the job is restarted
        (:meth:`_end_old_copies`)."""
        self.requeue = scheduler.requeue_policy()  # restarts, rejoining workers, incarnations
        self.timeline: dict[str, float] = {}
        self.progress = Progress(f"{cfg.exp}/{cfg.trial}", cfg.controller.progress)
        self._t0 = time.time()
        self.recovery = Recovery(cfg.recovery(), experiment.stateful, self._t0)
        self.pauses = PauseWatch()  # (see _paused)
        self.watch = MasterProgress()
        self._watch_t0: float | None = None  # the first watch's start: a recovery keeps it
        self._names_down = False  # the trial failed because name resolution stopped answering
        self._names_foreign = False  # another trial of this name holds the keys
        self.names = NameWatch(name_resolve, cfg.exp, cfg.trial, cfg.controller.heartbeat_ttl)
        self.late = LateBeats(cfg.controller.hang_grace)
        self.outcome = ""  # the summary's status once run() returned
        self.status = StatusWriter(cfg, paths, self._t0, self.timeline, self.logs, name_resolve,
                                   self.recovery.summary)

    # --- the whole trial ---
    def run(self) -> int:
        summary = TrialSummary(self.cfg, self._t0)
        self.timeline["start"] = self._t0
        self.status.write("starting")
        try:
            taken = claim_problem(self.nr, self.cfg.exp, self.cfg.trial, self.paths.root)
            if taken is not None:
                self._names_foreign = True  # (its keys are not ours to clear)
                raise WorkerFailure(taken)
            left = self.scheduler.cancel_leftovers(leftover_logs(self.cfg))  # before the keys
            if left:
                print(f"cancelled job(s) {', '.join(left)}, left by an earlier run of this trial "
                      "whose controller died", file=sys.stderr)
            self.nr.clear_subtree(names.trial_root(self.cfg.exp, self.cfg.trial))
            self.nr.add(names.controller(self.cfg.exp, self.cfg.trial),
                        controller_record(self.paths.root), replace=True,
                        keepalive_ttl=self.cfg.controller.heartbeat_ttl)
            groups = [g for g in self.groups.values() if g.count]
            self.scheduler.preflight(groups)  # what can never run fails before submitting
            if self.recovery.enabled:  # spares first: they start the workers too (local)
                self.scheduler.warm_spares(
                    start_wait=min(self.cfg.controller.register_timeout, SPARE_START_WAIT))
            for kind, ids in self.scheduler.submit_all(groups, self._spares_importing).items():
                summary.submitted(kind, ids)
            self.timeline["submitted"] = time.time()
            self._start_recovering(summary)
            summary.completed(self._watch_recovering(summary))
        except (WorkerFailure, SchedulerError) as e:
            failure = e if isinstance(e, WorkerFailure) else WorkerFailure(str(e))
            failure = full_disk_cause(failure, self.paths.root, self.paths.checkpoints)
            summary.failed(failure)
            self.progress.say(f"\nerror: {failure}")
        except (NameServiceUnavailable, NameServiceRefused) as e:  # gone, or refusing
            self._names_down = isinstance(e, NameServiceUnavailable)
            failure = WorkerFailure(f"name resolution failed: {e}")
            summary.failed(failure)
            self.progress.say(f"\nerror: {failure}")
        except KeyboardInterrupt as e:
            summary.interrupted(cancelled=isinstance(e, TrialCancelled)  # (or ctl's SIGTERM)
                                or cancelled_since(self.paths, summary.t0))
            if isinstance(e, ControllerRequeue):  # its job's time limit or preemption
                summary.requeued(str(e), self._requeue_record(e.seconds_left()))
            self.progress.say(f"\n{summary.status}: stopping every worker")
        finally:  # cleanup and records must finish: no signal stops them (see launch.py)
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self.progress.close()
                self.status.write("stopping", failure=summary.data.get("failure"))
                self._stop_all()
                written = summary.finish(self.paths.summary, self.recovery.summary(),
                                         self.status.progress, self.timeline, self.requeue.restarts)
                self.status.final(summary.data, self._poll_fresh)
                self.pauses.close()
            finally:
                signal.signal(signal.SIGINT, old)
        print(f"{summary.status}: {self.paths.summary}" if written else
              f"{summary.status} (no summary.json: see above)", file=sys.stderr)
        self.outcome = summary.status
        return 0 if summary.status == "completed" else 1

    # --- phases ---
    def _check_jobs(self, phase: str, statuses: list[JobStatus] | None = None) -> None:
        failure = job_failure(self.scheduler.poll() if statuses is None else statuses, phase)
        if failure is not None:
            raise failure

    def _poll(self, fresh: bool = False) -> list[JobStatus]:
        """The jobs' states; one that looks ended is asked again while a requeue may explain
        it (see :meth:`RequeuePolicy.settle`). Keeps ``status.json`` up to date, and stops the
        trial (:class:`TrialCancelled`) when ``system.ctl cancel`` asked for it."""
        statuses = self.requeue.settle(self.scheduler.poll(fresh=fresh), self._poll_fresh)
        self.status.tick(statuses)
        return statuses

    def _running(self, worker: str) -> bool:
        """Whether the scheduler sees ``worker``'s job running (say, hung, not dead)."""
        return any(worker in st.workers and st.state == JobState.RUNNING
                   for st in self.scheduler.poll())

    def _spares_importing(self) -> None:
        """While the start waits for warm spares' imports: say so, keep ``status.json``, look
        at a stop request (Ctrl-C redelivered, ``system.ctl cancel``)."""
        self.progress.update(spares="importing")
        self.status.tick(self.scheduler.poll())

    def _poll_fresh(self) -> list[JobStatus]:
        return self.scheduler.poll(fresh=True)

    def _note_restarts(self, statuses: list[JobStatus]) -> None:
        """A requeued job's workers are rejoining: they will register again, at new addresses."""
        self._restarted(self.requeue.note(statuses))

    def _restarted(self, restarts: list[Restart]) -> None:
        for r in restarts:
            self._drop_clients(r.rejoining)
            self._end_old_copies(r.rejoining, r.job.restarts)
            print(f"\njob {r.job.job_id} ({', '.join(r.job.workers)}) was requeued "
                  f"(restart {r.job.restarts}); waiting for its workers to rejoin",
                  file=sys.stderr)

    def _drop_clients(self, workers: Iterable[str]) -> None:
        for w in workers:
            client = self.clients.pop(w, None)
            if client is not None:
                client.close()

    def _check_reported_errors(self) -> None:
        """Raise a worker's report of its exception; named after another worker whose job had
        already ended (the report is then that death's consequence: a SIGKILLed model worker
        makes its peers' collectives fail, and the master's call to them)."""
        errors = self.names.errors()
        failure = reported_failure(errors, self.logs)
        if failure is None:
            return
        reporters = [names.worker_of(k) for k in errors]
        try:  # a plain fresh poll first: settling requeues (Slurm: seconds) only when needed
            if root_cause(failure, self.scheduler.poll(fresh=True), reporters) is not failure:
                failure = root_cause(failure, self._poll(fresh=True), reporters)
        except SchedulerError:  # the report is what is known
            pass
        raise failure

    def _await_report(self, seconds: float) -> None:
        """Raise a worker's own report of its failure if one arrives within ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._check_reported_errors()
            time.sleep(0.1)

    def _wait_registered(self, expected: set[str] | None = None) -> None:
        """Until every worker (or every one of ``expected``) registered its address. Queue time
        does not count: a worker's ``register_timeout`` starts when its job starts running;
        pending jobs show in the progress line with their reason, and a job the scheduler
        judged blocked (can never start, or past its queue timeout) fails the trial at once.
        Only an ended job of ``expected`` fails the wait: in a recovery, another one (lost with
        the same node) is the watch's to find next, not a failure of this restart."""
        timeout = self.cfg.controller.register_timeout
        expected = set(self.logs) if expected is None else expected
        clock = StartClock()
        while True:
            found = self.names.registered()
            registered = expected & set(found)
            self.progress.update(registered=f"{len(registered)}/{len(expected)}",
                                 pending=clock.pending_text())
            if registered == expected:
                break
            self._check_reported_errors()
            statuses = self._poll()
            for line in clock.update(statuses, expected):
                print(f"\n{line}", file=sys.stderr)
            failure = blocked_failure(statuses)
            if failure is not None:
                raise failure
            self._check_jobs("before registering",
                             [st for st in statuses if expected & set(st.workers)])
            missing = clock.overdue(expected - registered, timeout)
            if missing:
                logs = "\n".join(f"  {w}: {self.logs[w]}" for w in missing)
                raise WorkerFailure(f"{len(missing)} worker(s) did not register within "
                                    f"{timeout:.0f}s of their job starting: "
                                    f"{', '.join(missing)}\n{logs}", missing[0],
                                    self.logs[missing[0]])
            # (at most a second between listings of a thousand workers; a recovery waiting
            # for two lists again within 0.05 s)
            time.sleep(self.names.registration_interval(0.02, 0.05 + len(expected) / 1000))
        self.timeline.setdefault("registered", time.time())  # the start's, not a recovery's
        for name, address in found.items():
            if name in expected:
                self.addresses[name] = address
                self.clients[name] = client_for(
                    name, RpcClient(self.codec, address, self.cfg.rpc.request_timeout))

    def _ordered(self, kinds: tuple[str, ...] = tuple(KINDS)) -> list[WorkerClient]:
        """Clients of every worker of ``kinds``, in order, but those rejoining after a requeue
        (configured and started by :meth:`_rejoin` once they registered again)."""
        return [self.clients[w] for k in kinds for w in self.groups[k].worker_names()
                if w not in self.requeue.rejoining]

    def _start_all(self, clients: list[WorkerClient]) -> None:
        """Start every client at once (see :meth:`_check`)."""
        self._check(clients, "start", collect_settled([c.start() for c in clients],
                                                      self.cfg.rpc.request_timeout))

    def _configure_all(self, clients: list[WorkerClient]) -> None:
        """Configure every client at once; record the incarnation each answers from (before
        judging failures: a worker configured in its new incarnation is not waited for)."""
        configs = worker_configs(self.cfg, self.experiment)
        results = collect_settled([c.configure(configs[c.kind]) for c in clients],
                                  self.cfg.rpc.request_timeout)
        restarted = False
        for c, r in zip(clients, results):
            if isinstance(r, dict):
                self.requeue.configured(c.name, int(r["restart"]))
                restarted |= int(r["restart"]) > 0
        self._remember_incarnations([c.name for c, r in zip(clients, results)
                                     if isinstance(r, dict)])
        if restarted:
            # a requeued job can be running again before any poll saw it pending: its workers
            # say so here; a fresh look records the restart (they are not waited for again)
            self._note_restarts(self._poll_fresh())
        self._check(clients, "configure", results)

    def _check(self, clients: list[WorkerClient], method: str, results: list[Any]) -> None:
        """A failed call fails the trial unless the worker's job was requeued (preempted during
        start-up): it rejoins later instead."""
        for c, r in zip(clients, results):
            if isinstance(r, Exception) and not self._requeued(c.name):
                failed = WorkerFailure(f"{method} of worker {c.name} failed: {r}; log: "
                                       f"{self.logs[c.name]}", c.name, self.logs[c.name])
                raise self._ended_job(f"during {method}", failed)

    def _ended_job(self, phase: str, failed: WorkerFailure) -> WorkerFailure:
        """``failed`` (a call that failed) named after a job that ended meanwhile, if one did
        within :data:`CAUSE_GRACE` seconds: a cancelled job's workers refuse calls as they stop
        (the scheduler shows it ended once its processes are gone)."""
        deadline = time.monotonic() + CAUSE_GRACE
        while True:
            try:
                cause = call_failure_cause(failed, self._poll_fresh(), phase)
            except SchedulerError:  # the failed call is what is known
                return failed
            if cause is not None:
                return cause
            if time.monotonic() > deadline:
                return failed
            time.sleep(0.5)

    def _requeued(self, worker: str) -> bool:
        """Whether ``worker``'s job was requeued (see :meth:`RequeuePolicy.wait_requeued`)."""
        return self.requeue.wait_requeued(worker, self._poll_fresh, self._restarted)

    def _configure(self) -> None:
        self._configure_all(self._ordered())
        self.timeline["configured"] = time.time()

    def _start(self) -> None:
        self._start_all(self._ordered(tuple(k for k in KINDS if k != "master")))
        self._start_all(self._ordered(("master",)))
        self.timeline["started"] = time.time()
        if self.recovery.enabled:  # restarts will come: spares that are already imported
            self.scheduler.warm_spares()

    def _watch(self) -> dict[str, Any]:
        cc = self.cfg.controller
        last_master_answer = time.monotonic()
        if self._watch_t0 is None:  # controller.timeout counts from here, recoveries included
            self._watch_t0 = last_master_answer
        started = self._watch_t0
        while True:
            paused = self._paused()
            if paused is not None:
                raise paused
            self._check_reported_errors()
            statuses = self._poll()
            self._note_restarts(statuses)
            blocked = blocked_failure(s for s in statuses if s.restarts)  # (a requeue loop)
            if blocked is not None:
                raise blocked
            self._recover_requeued_state()
            self._check_jobs("before the trial completed", statuses)
            self._rejoin()
            beating = self.names.beating(self.logs)
            dead = sorted(set(self.logs) - beating - set(self.requeue.rejoining))
            if dead and self.nr.outage_within(cc.heartbeat_ttl):
                dead = []  # name resolution was down: heartbeats refresh within one TTL
            running = self._vouched(statuses, dead)
            dead, late = self.late.judge(dead, running)  # a running one may be slow
            for w in late:
                print(f"\nworker {w}: {self.late.describe(cc.heartbeat_ttl)}", file=sys.stderr)
            if dead:  # a requeue may explain it: ask the scheduler afresh before judging
                statuses = self._poll(fresh=True)
                self._note_restarts(statuses)
                self._check_jobs("before the trial completed", statuses)
                dead = [w for w in dead if w not in self.requeue.rejoining
                        and not (self.scheduler.preempted(w) and self._requeued(w))]
            if dead:
                self._await_report(REPORT_GRACE)  # a worker that says why is named with it
                hung = f", nor {cc.hang_grace:.0f}s more while its process ran" if (
                    cc.hang_grace and dead[0] in running) else ""
                stacks = self._dump_stacks() if dead[0] in running else ""
                hung += f"; {stacks}" if stacks else ""
                raise WorkerFailure(
                    f"worker {', '.join(dead)} stopped heart-beating (no refresh within "
                    f"{cc.heartbeat_ttl:.1f}s{hung}); log: {self.logs[dead[0]]}", dead[0],
                    self.logs[dead[0]])
            if "master/0" in self.requeue.rejoining:
                ping: dict[str, Any] = {}
            else:
                master = self.clients["master/0"]
                try:
                    ping = master.ping().result(max(cc.poll_interval * 5, 1.0))
                    last_master_answer = time.monotonic()
                except RpcError:  # (a master whose process runs may be slow: see hang_grace)
                    if time.monotonic() - last_master_answer > cc.heartbeat_ttl + (
                            cc.hang_grace if self._vouched(statuses, ["master/0"]) else 0):
                        stacks = self._dump_stacks()
                        stacks = f" ({stacks})" if stacks else ""
                        raise WorkerFailure(f"master does not answer{stacks}; log: "
                                            f"{self.logs['master/0']}", "master/0",
                                            self.logs["master/0"]) from None
                    ping = {}
            state = ping.get("state")
            prog = ping.get("progress") or {}
            self._note_progress(prog)
            self.progress.update(running=len(beating), state=state,
                                 rejoining=len(self.requeue.rejoining) or None,
                                 **prog,
                                 time=f"{time.monotonic() - started:.1f}s")
            if state == "completed":
                self.timeline["completed"] = time.time()
                return master.report().result()["result"]
            if cc.timeout and time.monotonic() - started > cc.timeout:
                raise WorkerFailure(f"trial did not complete within controller.timeout="
                                    f"{cc.timeout:.0f}s")
            time.sleep(cc.poll_interval)

    def _vouched(self, statuses: list[JobStatus], silent: Iterable[str]) -> frozenset[str]:
        """Those of the ``silent`` workers whose own process is known to run: each alone in a
        running job, or in a running job of several and vouched for by its witness."""
        alone = vouched(statuses) & set(silent)
        asked = (set(silent) & shared(statuses)) - alone
        return alone | frozenset(self.names.alive(asked)) if asked else alone

    def _stop_all(self) -> None:
        self.nr.stopping(NAMES_CLEANUP_WAIT)  # (a name service down meanwhile is not waited out)
        clients = list(self.clients.values())
        for first in (True, False):  # the master first: what its calls then raise is no failure
            collect_settled([c.stop() for c in clients if (c.kind == "master") == first],
                            1.0 if first else 2.0)
        # the jobs of workers asked to stop get the grace to end by themselves; one of a worker
        # that was not asked (not registered with this controller yet: forked from a spare
        # just now) cannot end that way: waiting for it would only delay its SIGTERM
        asked = {c.name for c in clients}
        deadline = time.monotonic() + self.cfg.scheduler.stop_grace
        while time.monotonic() < deadline and any(
                s.state.active and s.state != JobState.UNKNOWN and set(s.workers) <= asked
                for s in self.scheduler.poll()):
            time.sleep(0.05)
        try:
            self.scheduler.stop_all(self.cfg.scheduler.stop_grace)
        except RLSystemError as e:
            print(f"\nerror while stopping: {e}", file=sys.stderr)
        for c in clients:
            c.close()
        if self._names_down:  # not waited for again: the next launch clears them
            log.warning("name-resolve keys left in place: the name service does not answer")
        elif not self._names_foreign:
            try:
                self.nr.clear_subtree(names.trial_root(self.cfg.exp, self.cfg.trial))
            except Exception as e:  # the backend may be gone; keys expire on their own
                log.warning("could not clear name-resolve keys: %s", e)
        self.nr.close()
        self.timeline["stopped"] = time.time()


__all__ = ["Controller", "group_specs", "worker_configs"]
