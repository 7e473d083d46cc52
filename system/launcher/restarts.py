"""The controller's automatic recovery: restart the stateful workers from the latest checkpoint
after one of them failed, or a failed stateless worker alone, and go on watching.

A mixin of :class:`~system.launcher.controller.Controller`: it works on the controller's state
(its clients, groups, logs, requeue policy and :class:`~system.launcher.recovery.Recovery`) and
calls its phases (register, configure, start, watch) again for the restarted workers. The policy
(whether and what to restart, back-off, the summary) is :mod:`system.launcher.recovery`'s.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Callable, Iterable

from experiments.registry import Experiment
from scheduler.base import Scheduler
from scheduler.requeue import RequeuePolicy
from system import names
from system.errors import (NameEntryNotFound, NameResolveError, SchedulerError,
                           WorkerFailure, first_line)
from system.launcher.config import ExperimentConfig
from system.launcher.disk import full_disk_cause
from system.launcher.eval_mode import checkpoint_steps
from system.launcher.failures import clear_worker_keys
from system.launcher.groups import GroupSpec, group_spec
from system.launcher.pause_watch import PauseWatch
from system.launcher.recovery import MasterProgress, Paused, Recovery, Requeued
from system.launcher.self_requeue import checkpoint_first
from system.launcher.status_file import StatusWriter
from system.launcher.summary import TrialSummary
from system.launcher.watch import NameWatch
from system.launcher.witness import order_stop, order_stop_of
from system.name_resolve import NameResolve
from system.paths import TrialPaths
from system.rpc import RpcClient
from system.wire import Codec
from workers.checkpoint_window import controller_checkpoint_wait
from workers.client import WorkerClient, collect_settled
from workers.kinds import KINDS, client_for

log = logging.getLogger("controller")

STACKS_WAIT = 1.0
"""Seconds the workers asked for their stacks get to write them before they are stopped."""
RESTART_GRACE = 0.0
"""Seconds a recovery gives the stateful workers it stops before SIGKILL: none, their state is
abandoned for the checkpoint's (written atomically: a kill cannot tear it), and a survivor
mid-step would only delay the restart (up to its whole grace)."""


class RecoveringController:
    """The recovery half of the controller (see the module's docstring). It uses the
    controller's state below and its phases ``_watch``, ``_wait_registered``, ``_configure``,
    ``_start``, ``_configure_all``, ``_start_all``, ``_check``, ``_drop_clients``,
    ``_note_restarts``, ``_poll_fresh`` and ``_running``. It also takes up again the workers
    that a requeue or a respawn restarted (``_rejoin``)."""

    cfg: ExperimentConfig
    experiment: Experiment
    paths: TrialPaths
    scheduler: Scheduler
    nr: NameResolve
    groups: dict[str, GroupSpec]
    logs: dict[str, str]
    clients: dict[str, WorkerClient]
    addresses: dict[str, str]
    requeue: RequeuePolicy
    recovery: Recovery
    watch: MasterProgress
    timeline: dict[str, float]
    pauses: PauseWatch
    status: StatusWriter
    names: NameWatch
    codec: Codec

    def _recover_requeued_state(self) -> None:
        """A requeued (preempted) worker that holds training state is not simply let back in:
        with ``recover=auto`` every stateful worker restarts from the latest checkpoint (the
        preempted ones asked the master for one on SIGUSR2), as after a failure."""
        if not self.recovery.enabled:
            return
        for w in sorted(self.requeue.rejoining):
            if w.split("/")[0] in self.experiment.stateful:
                raise Requeued(f"the job of {w} was requeued (preempted or at its time "
                               f"limit); log: {self.logs[w]}", w, self.logs[w])

    def _rejoin(self) -> None:
        """Configure and start requeued workers once they registered again. A worker that
        registers at a new address was restarted, even if no poll caught its job pending (a
        requeued job can be running again within a second)."""
        rejoining = self.requeue.rejoining
        found = self.names.addresses(self.logs, rejoining)
        moved = [w for w, a in found.items()
                 if w in self.addresses and a != self.addresses[w] and w not in rejoining]
        if moved:
            self._note_restarts(self._poll_fresh())  # records the restart count
            self.requeue.moved(moved)
            self._drop_clients(moved)
        self._recover_requeued_state()
        if not rejoining:
            return
        back = [w for w in rejoining if w in found and found[w] != self.addresses.get(w)]
        self.requeue.queued(w for st in self.scheduler.poll() if st.queued for w in st.workers)
        overdue = self.requeue.overdue(back)
        if overdue:
            w = overdue[0]
            raise WorkerFailure(f"restarted worker {w} did not rejoin within "
                                f"{self.requeue.rejoin_timeout:.0f}s; "
                                f"log: {self.logs[w]}", w, self.logs[w])
        if not back:
            return
        clients = []
        for w in back:
            self.addresses[w] = found[w]
            self.clients[w] = client_for(w, RpcClient(self.codec, found[w],
                                                      self.cfg.rpc.request_timeout))
            clients.append(self.clients[w])
        try:
            self._configure_all(clients)
        except WorkerFailure:  # the others are configured again and started at the next poll
            self._forget_addresses(back)
            raise
        results = collect_settled([c.start() for c in clients], self.cfg.rpc.request_timeout)
        started = [c.name for c, r in zip(clients, results) if not isinstance(r, Exception)]
        try:
            self._check(clients, "start", results)
        finally:  # those started have rejoined, also when another one failed; the others are
            self.requeue.rejoined([w for w in started if w in self.requeue.rejoining])
            self.recovery.running(started)  # tried again at the next poll (or restarted)
            self._forget_addresses([w for w in back if w not in started])
            if started:
                print(f"\nrejoined: {', '.join(started)}", file=sys.stderr)

    def _forget_addresses(self, workers: list[str]) -> None:
        """Rejoining ``workers`` whose call failed are taken up again at the next poll: kept,
        their address would look known, and they would wait out their deadline."""
        for w in workers:
            self.addresses.pop(w, None)
        self._drop_clients(workers)

    def _paused(self, then: WorkerFailure | None = None) -> Paused | None:
        """This process was stopped (SIGSTOP, a suspended machine) for longer than
        ``controller.orphan_timeout`` since the last look: its workers judge it gone and stop
        themselves, each exit a failure of its own were they not all restarted at once.
        ``then``: a failure found meanwhile (one of those exits, most likely)."""
        gap, limit = self.pauses.take(), self.cfg.controller.orphan_timeout
        if gap <= limit:
            return None
        return Paused(f"the controller was stopped for {gap:.0f}s, longer than "
                      f"controller.orphan_timeout={limit:.0f}s: every worker stopped itself"
                      + (f"\nthen {first_line(then)}" if then is not None else ""),
                      "master/0", self.logs["master/0"])

    def _start_recovering(self, summary: TrialSummary) -> None:
        """Register, configure and start every worker. A worker that fails meanwhile (killed,
        its node lost) restarts every worker afresh (nothing has trained yet, and the others
        may be waiting on it in a collective), up to ``recover.retries`` times."""
        try:
            self._wait_registered()
            self._configure()
            self._start()
        except WorkerFailure as e:  # (or the controller paused: named after that)
            self._recover_until_running(self._paused(e) or e, summary, every_kind=True)
            self.timeline["started"] = time.time()
            if self.recovery.enabled:
                self.scheduler.warm_spares()

    def _watch_recovering(self, summary: TrialSummary) -> dict[str, Any]:
        """Watch until the master completes; a failure of a stateful worker restarts the
        stateful workers from the latest checkpoint, up to ``recover.retries`` times."""
        while True:
            try:
                return self._watch()
            except WorkerFailure as e:  # (after a pause of the controller every worker restarts)
                failure = e if isinstance(e, Paused) else self._paused(e) or e
                self._recover_until_running(failure, summary,
                                            every_kind=isinstance(failure, Paused))

    def _recover_until_running(self, failure: WorkerFailure, summary: TrialSummary,
                               every_kind: bool = False) -> None:
        """Recover from ``failure``, and from each failure during that recovery, until the
        restarted workers run (or raise the one that is not recovered)."""
        while True:
            failure = full_disk_cause(failure, self.paths.root, self.paths.checkpoints)
            if not self.recovery.should_recover(failure):
                raise self.recovery.unrecovered(failure)
            try:
                self._recover(failure, summary, every_kind)
                return
            except WorkerFailure as e:
                failure = e
            except SchedulerError as e:  # (a stalled slurmctld: it ended the trial, retries
                # unused) one more failure of the same kind, recovered as it was
                failure = type(failure)(f"the recovery of {failure.worker} failed: {e}",
                                        failure.worker, failure.log_path, failure.also)

    def _recover(self, failure: WorkerFailure, summary: TrialSummary,
                 every_kind: bool = False) -> None:
        """A stateless worker that failed restarts alone (:meth:`_respawn`). When a stateful
        worker failed: stop every stateful group, wait the back-off, start them again (their
        own logs); they restore the latest checkpoint. The other groups stay up.
        ``every_kind`` (a failure while the trial starts): every group restarts."""
        if not every_kind and not self.recovery.restarts_stateful(failure):
            self._respawn(failure, summary)
            return
        attempt = self.recovery.begin(failure, self._last_step())
        kinds = (tuple(k for k in KINDS if self.groups[k].count) if every_kind
                 else self.recovery.kinds_to_restart(failure, tuple(KINDS)))
        self.recovery.incomplete = set(kinds)
        workers = [w for k in kinds for w in self.groups[k].worker_names()]
        attempt.restarted = list(workers)
        how = ("not a failure: no recover.retries drawn on" if attempt.free else
               f"attempt {self.recovery.count(attempt)} of "
               f"{self.recovery.cfg.retries if self.recovery.cfg else 0}")
        print(f"\n{attempt.cause}\nrecovering ({how}): restarting {', '.join(kinds)}"
              + (" from the latest checkpoint" if set(kinds) & set(self.experiment.stateful)
                 else ""), file=sys.stderr)
        # their state is abandoned (the checkpoint is on disk) and a survivor may be stuck in
        # a call to the dead worker: no graceful stop is waited for
        # (the failed one is not asked: it is dead, or past helping)
        collect_settled([self.clients[w].stop() for w in workers
                         if w in self.clients and w != failure.worker], 0.2)
        self._drop_clients(workers)
        self.requeue.rejoined([w for w in workers if w in self.requeue.rejoining])
        for k in kinds:
            self.scheduler.stop_group(k, min(self.cfg.scheduler.stop_grace, RESTART_GRACE))
        clear_worker_keys(self.nr, self.cfg.exp, self.cfg.trial, workers,
                          stateful=bool(set(kinds) & set(self.experiment.stateful)))
        self._end_old_copies(workers)  # (after the clear: it removes stop orders too)
        time.sleep(self.recovery.backoff())
        for k in kinds:
            group = group_spec(k, self.groups[k].count, self.paths, self.scheduler.python,
                               attempt.attempt)
            self.groups[k] = group
            self.logs.update(zip(group.worker_names(), group.log_paths))
            summary.submitted(k, self.scheduler.submit(group))
        self._wait_registered(set(workers))
        self._configure_all([self.clients[w] for w in workers])
        for k in kinds:
            self._start_all([self.clients[w] for w in self.groups[k].worker_names()])
        self.recovery.running()
        self.recovery.incomplete = set()
        self.watch.restarted()
        print(f"recovered: {', '.join(workers)} running again", file=sys.stderr)

    def _remember_incarnations(self, workers: list[str]) -> None:
        """Note the process each of ``workers`` (configured just now) runs as: its witness's
        record, with the job's restart count it answered ``configure`` from."""
        try:
            alive = self.names.alive(workers)
        except NameResolveError as e:  # (then no order can name it: as before)
            log.warning("could not read the workers' process records: %s", e)
            return
        for w, record in alive.items():
            self.incarnations[w] = (record, self.requeue.incarnation.get(w, -1))

    def _end_old_copies(self, workers: Iterable[str], restart: int | None = None) -> None:
        """Order the witness of each of ``workers``' previous processes to end it, should it
        still run: a job Slurm restarted elsewhere after its node's slurmd was lost left them
        running beside their replacements, their keep-alive refreshes overwriting the new
        heartbeats, until their orphan timeout after the trial. ``restart``: the job's restart
        count now (a requeue): only a process configured from an earlier one is named (never
        the process that runs now); None: the controller restarts them itself (a recovery)."""
        for w in workers:
            remembered = self.incarnations.get(w)
            if remembered is None or (restart is not None and remembered[1] >= restart):
                continue
            old = self.incarnations.pop(w)[0]
            try:
                order_stop_of(self.nr, self.cfg.exp, self.cfg.trial, w, old,
                              self.cfg.scheduler.stop_grace)
                log.info("%s: its previous process (%s) is ordered to end, if it runs", w, old)
            except NameResolveError as e:
                log.warning("could not order %s's previous process to end: %s", w, e)

    def _respawn(self, failure: WorkerFailure, summary: TrialSummary) -> None:
        """Restart the failed stateless worker alone, at once, and go on watching: it rejoins
        like a requeued worker (:meth:`_rejoin` configures and starts it once it registered);
        training goes on meanwhile."""
        w = failure.worker
        assert w is not None
        kind, index = w.split("/")
        attempt = self.recovery.begin(failure, self._last_step(), restarted=[w])
        print(f"\n{attempt.cause}\nrecovering (attempt {self.recovery.count(attempt)} of "
              f"{self.recovery.cfg.retries if self.recovery.cfg else 0} for {w}): restarting "
              f"{w} alone; training goes on", file=sys.stderr)
        if w in self.clients and self._running(w):  # a dead one cannot answer: no wait
            collect_settled([self.clients[w].stop()], 1.0)
        self._drop_clients([w])
        self.scheduler.stop_worker(w, self.cfg.scheduler.stop_grace)
        clear_worker_keys(self.nr, self.cfg.exp, self.cfg.trial, [w], stateful=False)
        # a process still vouched for may share a running Slurm job (a hung one: Slurm cannot
        # stop one task of it): its witness ends it, not to run on beside its replacement
        ended = order_stop(self.nr, self.cfg.exp, self.cfg.trial, w,
                           self.cfg.scheduler.stop_grace)
        if ended is not None:
            print(f"{w}: its witness vouches for process {ended}: ordered to end it",
                  file=sys.stderr)
        self.addresses.pop(w, None)
        group = group_spec(kind, 1, self.paths, self.scheduler.python, attempt.attempt,
                           first=int(index))
        self.logs[w] = group.log_paths[0]
        summary.submitted(kind, self.scheduler.submit(group))
        self.requeue.respawned([w], self.cfg.controller.register_timeout)

    def _last_step(self) -> int | None:
        """The last step the master reported: its progress key outlives it (a poll may have
        missed the last step before a crash)."""
        try:
            self.watch.update(json.loads(self.nr.get(names.progress(self.cfg.exp,
                                                                    self.cfg.trial))))
        except (NameEntryNotFound, ValueError):
            pass
        return self.watch.last_step

    def _note_progress(self, prog: dict[str, Any]) -> None:
        """Follow the master's progress: the step it reached, the step a restarted master
        resumed from, and whether it stalled (``controller.stall_timeout``)."""
        self.watch.update(prog)
        self.status.note_progress(prog)
        if self.watch.resumed_from is not None:
            self.recovery.resumed(self.watch.resumed_from)
        stall = self.cfg.controller.stall_timeout
        if stall and self.watch.unchanged_for() > stall:
            log_path = self.logs["master/0"]
            stacks = self._dump_stacks()
            raise WorkerFailure(f"master made no progress for {stall:.0f}s "
                                f"(controller.stall_timeout; last: {self.watch.progress}"
                                f"{'; ' + stacks if stacks else ''}); log: {log_path}",
                                "master/0", log_path)

    def _dump_stacks(self) -> str:
        """Before a hung worker (silent while its process runs, or a master that does not
        answer or progress) is stopped: ask every registered worker, but those rejoining, to
        write its threads' stacks to its log (where each one waits is the clue, a collective
        stuck on one rank, say). Returns what the failure says of it ("" if none was asked)."""
        workers = [w for w in self.addresses if w not in self.requeue.rejoining]
        try:
            asked = self.scheduler.dump_stacks(workers)
        except Exception as e:  # (a diagnosis: it must not hide the failure itself)
            log.warning("could not ask the workers for their stacks: %s", e)
            return ""
        if not asked:
            return ""
        time.sleep(STACKS_WAIT)  # (written from the signal handler itself: at once)
        return "every worker's threads' stacks are at the end of its log"

    def _requeue_record(self, seconds: float | None) -> dict[str, Any]:
        """What ``summary.json`` says of the controller's own requeue: whether the checkpoint
        asked first was committed (:meth:`_checkpoint_first`), and the steps the trial
        continues from and had reached (``checkpoint_step``: the newest committed checkpoint,
        also when the master wrote it by itself, preempted with this job; None: none yet;
        ``last_step``: the master's last report); their difference is what the requeue costs."""
        checkpointed = self._checkpoint_first(seconds)
        steps = checkpoint_steps(self.paths.checkpoints)
        return {"checkpointed": checkpointed, "checkpoint_step": steps[-1] if steps else None,
                "last_step": self._last_step()}

    def _checkpoint_first(self, seconds: float | None) -> bool:
        """The controller's job was warned of its end (its time limit or a preemption; Slurm
        ends it ``seconds`` from now, None: unknown, taken as ``signal_seconds``): a
        checkpoint before every worker stops, if the master is running (see
        :func:`checkpoint_first`)."""
        if "started" not in self.timeline or "master/0" not in self.clients:
            return False
        sched = self.cfg.scheduler
        warning = sched.slurm.signal_seconds if seconds is None else seconds
        wait = controller_checkpoint_wait(warning, sched.stop_grace)
        return checkpoint_first(self.nr, self.cfg.exp, self.cfg.trial, wait, self._master_ended())

    def _master_ended(self) -> Callable[[], bool]:
        """Whether the master's process has ended since this was made: its witness vouched
        for it, and no longer does (under Slurm, where every worker has one). A key never seen
        (a witness lost, the master gone already) or a name service that does not answer says
        nothing: the checkpoint is then waited for."""
        seen = [False]

        def ended() -> bool:
            if self.cfg.scheduler.type.value != "slurm":
                return False
            try:
                vouched = bool(self.names.alive(["master/0"]))
            except Exception:  # noqa: BLE001 - no news
                return False
            seen[0] = seen[0] or vouched
            return seen[0] and not vouched
        ended()
        return ended
