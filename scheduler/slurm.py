"""Slurm scheduler: one sbatch job per worker group, tracked with squeue / scontrol.

Nothing here depends on ``sacct`` (many clusters have no accounting storage). Raw Slurm states map
through :data:`STATE_TABLE` to :class:`~scheduler.base.JobState`; unknown ones become UNKNOWN.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Collection, Mapping, Sequence

from scheduler import slurm_preflight
from scheduler.base import GroupSpec, JobRequest, JobState, JobStatus, Scheduler
from scheduler.requeue import RequeuePolicy
from scheduler.slurm_cli import (STATE_TABLE, last_error, map_state, parse_sbatch_parsable,
                                 parse_scontrol_job, unreachable)
from scheduler.slurm_cli import run as _run
from scheduler.slurm_config import SlurmConfig, short_limit_message
from scheduler.slurm_leftovers import cancel_leftovers
from scheduler.slurm_jobs import (cancel_until_gone, het_leader, queued, scancel, scontrol_job,
                                  terminate)
from scheduler.slurm_queue import (blocked_message, held_after_launch_failure, hopeless,
                                   queue_timeout_message, unavailable_nodes)
from scheduler.slurm_marks import clear_forgotten, forgotten_mark, requeue_mark_prefix
from scheduler.slurm_render import (HETJOB, job_label, job_name, render_hetjob_script,
                                    render_worker_script, script_name)
from scheduler.slurm_submit import Submitter
from scheduler.slurm_updates import JobUpdates
from system.errors import SchedulerError
from system.thread_stacks import SCANCEL_STACKS

log = logging.getLogger("slurm")

__all__ = ["HetRequest", "STATE_TABLE", "SlurmRequest", "SlurmScheduler", "het_leader",
           "map_state", "parse_sbatch_parsable", "parse_scontrol_job", "ControllerRequest"]

@dataclasses.dataclass(frozen=True)
class SlurmRequest(JobRequest):
    group: GroupSpec
    script_path: str
    script: str

    def materialize(self) -> str:
        return self.script

    def describe(self) -> str:
        """What the job is, for messages: ``the master group``, ``the model and rollout
        groups``."""
        kinds = [g.kind for g in self.members()]
        return f"the {' and '.join(kinds)} group{'s' if len(kinds) > 1 else ''}"

    def write(self) -> str:
        os.makedirs(os.path.dirname(self.script_path), exist_ok=True)
        with open(self.script_path, "w") as f:  # under the trial's umask: sbatch reads it,
            f.write(self.script)                 # nobody executes it
        return self.script_path


@dataclasses.dataclass(frozen=True)
class HetRequest(SlurmRequest):
    """Every group of ``groups`` as one heterogeneous job (``scheduler.slurm.hetjob``);
    :meth:`SlurmScheduler.schedule` returns the components' ids ``<job>+<offset>``."""

    groups: tuple[GroupSpec, ...] = ()

    def members(self) -> tuple[GroupSpec, ...]:
        return self.groups


@dataclasses.dataclass(frozen=True)
class ControllerRequest(SlurmRequest):
    """The job that runs the trial's controller (``--detach``), on the master group's
    resources."""

    def describe(self) -> str:
        return "the trial's controller"


class SlurmScheduler(Scheduler):
    cancel_deadline: float = 180.0
    """Seconds :meth:`stop_all` keeps cancelling after the grace period before it gives up."""
    scancel_timeout: float = 30.0
    """Seconds one ``scancel`` may take before it counts as unanswered (and is tried again)."""
    query_timeout: float = 60.0
    """Seconds a poll's ``squeue`` may take before the poll is no news (see :meth:`_no_news`)."""

    def __init__(self, slurm: SlurmConfig, exp: str, trial: str, trial_dir: str, workdir: str,
                 umask: int = 0o077, gpus_per_worker: Mapping[str, int] | None = None) -> None:
        self.slurm = slurm
        self.gpus_per_worker = dict(gpus_per_worker or {})
        """Kind -> GPUs each of its workers uses (the experiment's demands; absent: none)."""
        self.umask = umask
        """File-creation mask of the jobs (set in every script, and passed to srun's tasks)."""
        self.exp, self.trial = exp, trial
        self.trial_dir = trial_dir
        self.workdir = workdir
        self._jobs: dict[str, GroupSpec] = {}
        self._forgotten: dict[str, set[str]] = {}
        """Job id -> its workers :meth:`stop_worker` forgot while the job ran others."""
        self._last_poll = 0.0
        self._cache: list[JobStatus] = []
        self._silent_since: float | None = None  # Slurm's controller has not answered since
        self._submitter = Submitter()
        self._updates = JobUpdates(slurm.requeue_release)
        self._submitted: dict[str, float] = {}  # job id -> when it was submitted (monotonic)

    @property
    def python(self) -> str:
        return self.slurm.python or sys.executable

    def requeue_policy(self) -> RequeuePolicy:
        # under hetjob the whole job requeues only once every group's workers stopped, the
        # stateful ones after the master's checkpoint: within the signal's warning time
        grace = max(self.slurm.requeue_grace, self.slurm.signal_seconds if self.slurm.hetjob
                    else 0)
        return RequeuePolicy(requeue=self.slurm.requeue, rejoin_timeout=self.slurm.rejoin_timeout,
                             requeue_grace=grace)

    # --- pure ---
    def plan(self, group: GroupSpec) -> SlurmRequest:
        """The script of ``group``'s job, under the trial's ``jobs/`` (a single worker's job
        past 0 gets its own file, beside its group's)."""
        script = render_worker_script(exp=self.exp, trial=self.trial, group=group,
                                      slurm=self.slurm, workdir=self.workdir, umask=self.umask,
                                      gpus_per_worker=self.gpus_per_worker.get(group.kind, 0))
        return SlurmRequest(group, os.path.join(self.trial_dir, "jobs", script_name(group)),
                            script)

    def plan_all(self, groups: Sequence[GroupSpec]) -> list[JobRequest]:
        """With ``hetjob`` (and two or more groups): one heterogeneous job for them all."""
        groups = [g for g in groups if g.count]
        if not self.slurm.hetjob or len(groups) < 2:
            return [self.plan(g) for g in groups]
        script = render_hetjob_script(exp=self.exp, trial=self.trial, groups=groups,
                                      slurm=self.slurm, workdir=self.workdir, umask=self.umask,
                                      gpus_per_worker=self.gpus_per_worker)
        return [HetRequest(groups[0], os.path.join(self.trial_dir, "jobs",
                                                   f"{HETJOB}.sbatch"), script, tuple(groups))]

    def preflight(self, groups: Sequence[GroupSpec]) -> None:
        """``sbatch --test-only`` of each group's own job, then the co-scheduling check
        (:mod:`scheduler.slurm_fit`), then with ``hetjob`` ``--test-only`` of the whole job."""
        groups = [g for g in groups if g.count]
        for g in groups:
            why = slurm_preflight.test_only(self.plan(g).write())
            if why is not None:
                raise slurm_preflight.rejected(g.kind, self.slurm.group(g.kind), why)
        slurm_preflight.co_schedule(self.slurm, groups, self.gpus_per_worker)
        for request in self.plan_all(groups):
            assert isinstance(request, SlurmRequest)
            if isinstance(request, HetRequest):
                why = slurm_preflight.test_only(request.write())
                if why is not None:
                    raise SchedulerError(f"sbatch --test-only rejects the heterogeneous job "
                                         f"(scheduler.slurm.hetjob=true) though each group "
                                         f"alone passes: {why}; set "
                                         "scheduler.slurm.hetjob=false")

    # --- effects ---
    def schedule(self, request: JobRequest) -> list[str]:
        assert isinstance(request, SlurmRequest)
        path = request.write()
        label = HETJOB if isinstance(request, HetRequest) else (
            "controller" if isinstance(request, ControllerRequest) else job_label(request.group))
        return self._submitter.submit(
            path, request.describe(), job_name(self.exp, self.trial, label),
            os.path.dirname(request.members()[0].log_paths[0]),
            {het_leader(j) for j in self._submitted},  # (every job it ever had: never taken)
            lambda job_id: self._record(request, job_id))

    def _record(self, request: SlurmRequest, job_id: str) -> list[str]:
        ids = [job_id] if not isinstance(request, HetRequest) else [
            f"{job_id}+{i}" for i in range(len(request.groups))]
        for j, group in zip(ids, request.members()):
            self._jobs[j] = group
            self._submitted[j] = time.monotonic()
            clear_forgotten(self._requeue_mark(j))  # (an earlier job's of the same id)
        self._last_poll = 0.0
        log.info("submitted %s as job %s", request.describe(), job_id)
        return ids

    @staticmethod
    def test_only(request: SlurmRequest) -> tuple[bool, str]:
        """Validate a written script with ``sbatch --test-only`` (nothing is queued)."""
        r = _run(["sbatch", "--test-only", request.write()])
        return r.returncode == 0, (r.stderr or r.stdout).strip()

    def poll(self, fresh: bool = False) -> list[JobStatus]:
        """Every job's state; a pending one with Slurm's reason, and ``blocked`` when that
        reason can never clear or it waited past ``queue_timeout``."""
        if not self._jobs:
            return []
        if not fresh and time.monotonic() - self._last_poll < self.slurm.poll_interval:
            return self._cache
        self._last_poll = time.monotonic()
        leaders = sorted({het_leader(j) for j in self._jobs})
        found: dict[str, tuple[str, str]] = {}
        try:
            r = _run(["squeue", "-h", "--states=all", "-j", ",".join(leaders), "-o",
                      "%i|%T|%r"], self.query_timeout)
        except SchedulerError as e:  # (it did not answer in time: an overloaded slurmctld)
            return self._no_news(str(e))
        if r.returncode == 0:
            for line in r.stdout.splitlines():
                parts = line.strip().split("|", 2)
                if len(parts) == 3 and parts[0] in self._jobs:
                    found[parts[0]] = (parts[1], parts[2])
        elif unreachable(r):  # (not one scontrol per job as well: each would wait too)
            return self._no_news(last_error(r))
        else:  # (say, a job Slurm has purged already: scontrol is asked for each below)
            log.warning("squeue failed: %s", r.stderr.strip())
        if self._silent_since is not None:
            log.warning("Slurm's controller answers again (silent for %.0fs)",
                        time.monotonic() - self._silent_since)
            self._silent_since = None
        statuses = []
        for job_id, group in self._jobs.items():
            raw, reason = found.get(job_id, ("", ""))
            restarts, info = 0, {}
            if fresh or not raw or map_state(raw) in (JobState.PENDING, JobState.REQUEUED):
                try:
                    info = scontrol_job(job_id, self.query_timeout)  # finished, restarts
                except SchedulerError:  # (no news: the job's state stays unknown this time)
                    info = {}
                raw = raw or info.get("JobState", "")
                reason = reason or info.get("Reason", "")
                restarts = int(info.get("Restarts", "0") or 0)
            state = map_state(raw) if raw else JobState.UNKNOWN
            if restarts and state == JobState.PENDING and reason == "BeginTime":
                self._updates.release_when_due(job_id, self.scancel_timeout)
            elif state == JobState.PENDING and held_after_launch_failure(reason):
                self._updates.release_held(job_id, self.scancel_timeout)
            workers, log_paths = self._live(job_id)
            waiting = reason if state in (JobState.PENDING, JobState.REQUEUED) and \
                reason != "None" else ""
            short = short_limit_message(job_id, group.kind, info.get("TimeLimit", ""),
                                        self.slurm.signal_seconds) if restarts else ""
            statuses.append(JobStatus(job_id, state, workers, log_paths,
                                      f"job {job_id} {raw or 'not found'}"
                                      + (f" ({reason})" if reason and reason != "None" else ""),
                                      restarts, waiting, (self.slurm.requeue and short) or
                                      self._blocked(job_id, group.kind, state, waiting,
                                                    restarts)))
        self._cache = statuses
        self._updates.after_answer(self._jobs)  # (Slurm answered this poll)
        return statuses

    def _no_news(self, why: str) -> list[JobStatus]:
        """Slurm's controller did not answer a poll: no news is no failure (it failed the trial).
        Every job's state is UNKNOWN (active: heartbeats judge its workers), said once."""
        if self._silent_since is None:
            self._silent_since = time.monotonic()
            log.warning("Slurm's controller does not answer (%s): the jobs' states are unknown "
                        "until it does", why)
        self._cache = [JobStatus(j, JobState.UNKNOWN, *self._live(j), "Slurm did not answer")
                       for j in self._jobs]
        return self._cache

    def _blocked(self, job_id: str, kind: str, state: JobState, reason: str,
                 restarts: int) -> str:
        """Why pending job ``job_id`` can never start (see :mod:`scheduler.slurm_queue`) or
        has waited past ``queue_timeout``; '' if neither."""
        if state != JobState.PENDING:
            return ""
        bad = hopeless(reason, reason.startswith("ReqNodeNotAvail")
                       and self._unknown_node(unavailable_nodes(reason)))
        if bad is not None:
            return blocked_message(kind, job_id, reason, *bad)
        waited = time.monotonic() - self._submitted.get(job_id, time.monotonic())
        if self.slurm.queue_timeout and not restarts and waited > self.slurm.queue_timeout:
            return queue_timeout_message(kind, job_id, reason, waited, self.slurm.queue_timeout)
        return ""

    @staticmethod
    def _unknown_node(nodes: list[str]) -> bool:
        """Whether Slurm knows none of a job's unavailable ``nodes`` by that name."""
        for node in nodes:
            r = _run(["scontrol", "show", "node", "-o", node])
            if r.returncode != 0 or not r.stdout.strip():
                return True
        return False

    def cancel_leftovers(self, logs_dirs: Sequence[str]) -> list[str]:
        """See :func:`scheduler.slurm_leftovers.cancel_leftovers`."""
        return cancel_leftovers(self.exp, self.trial, logs_dirs, self.cancel_deadline,
                                self.scancel_timeout)

    def stop_all(self, grace: float) -> None:
        """Cancel every job of the trial; return once none is left in the queue.

        A pending job cannot take a signal (``scancel --signal`` leaves it queued), so it is
        cancelled outright at once; a running one gets SIGTERM (its workers stop gracefully)
        and, after ``grace`` seconds, a plain ``scancel``. A busy slurmctld may not answer a
        ``scancel`` for a minute: each is retried with backoff, checked with ``squeue``, until
        the queue holds none of our jobs or :attr:`cancel_deadline` has passed; only then does
        this raise, naming the jobs left."""
        if not self._jobs:
            return
        ids = list(self._jobs)
        self._terminate(ids, grace)  # polite: workers stop gracefully
        left = cancel_until_gone(ids, time.monotonic() + self.cancel_deadline,
                                 self.scancel_timeout)
        if left:
            raise SchedulerError(f"jobs still in the queue {self.cancel_deadline:.0f}s after "
                                 f"scancel: {', '.join(left)}")

    def stop_group(self, kind: str, grace: float) -> None:
        """Cancel the jobs of group ``kind`` (SIGTERM first, as :meth:`stop_all`) and forget
        them, so the group can be submitted again. Slurm cannot cancel one component of a
        running heterogeneous job: such a component is only forgotten (its workers were told
        to stop over RPC; any left run until the job ends) and the job may no longer be
        requeued; the last component forgotten cancels the job."""
        ids = [j for j, g in self._jobs.items() if g.kind == kind]
        shared = [j for j in ids if self._het_siblings(j)]
        for j in shared:
            log.warning("job %s (%s) is a component of a heterogeneous job: forgotten, not "
                        "cancelled (the job runs on for the other groups)", j, kind)
            self._mark_forgotten(j, self._live(j)[0])
            self._updates.no_requeue(j, self.scancel_timeout)
        self._cancel([j for j in ids if j not in shared], grace, f"jobs of the {kind} group")
        self._forget(ids)

    def dump_stacks(self, workers: Collection[str]) -> list[str]:
        """``scancel --signal=URG`` (the job's tasks, not its batch script) to each running job
        of one of ``workers`` (a task of another worker, or one still starting, ignores it
        or writes its stacks too)."""
        wanted = set(workers)
        ids = [j for j in self._jobs if wanted & set(self._live(j)[0])]
        in_queue = queued(ids, self.scancel_timeout) or {}
        ids = [j for j in ids if in_queue.get(j) == JobState.RUNNING]
        if ids:
            scancel(ids, SCANCEL_STACKS, timeout=self.scancel_timeout)
        return ids

    def stop_worker(self, name: str, grace: float) -> None:
        """Stop worker ``name`` and forget it. Its job is cancelled (as :meth:`stop_group`
        does) when it runs no other worker (nor other groups: a heterogeneous job), or has
        ended. Slurm cannot stop one task of a step: while the job runs others, the worker
        (dead, or told to stop over RPC) is only forgotten, and the job may no longer be
        requeued (its restart would start the worker again beside its replacement). A worker
        of a queued job with others cannot be stopped alone: SchedulerError."""
        job_id = next((j for j in self._jobs if name in self._live(j)[0]), None)
        if job_id is None:
            return
        others = [w for w in self._live(job_id)[0] if w != name] + [
            w for j in self._het_siblings(job_id) for w in self._live(j)[0]]
        in_queue = queued([job_id], self.scancel_timeout) if others else {}
        if in_queue and in_queue[job_id] in (JobState.PENDING, JobState.REQUEUED):
            raise SchedulerError(f"worker {name} is queued in job {job_id} with "
                                 f"{', '.join(others)}: stop its group instead")
        if in_queue is None or job_id in in_queue:  # running others (or squeue did not say)
            self._mark_forgotten(job_id, [name])
            self._forgotten.setdefault(job_id, set()).add(name)
            self._updates.no_requeue(job_id, self.scancel_timeout)
        else:
            self._cancel([job_id], grace, f"job {job_id} of {name}")
            self._forget([job_id])
        self._last_poll = 0.0

    def _mark_forgotten(self, job_id: str, workers: Sequence[str]) -> None:
        """``workers`` of running job ``job_id`` are restarted elsewhere: should the job
        requeue all the same (with requeue on), their copies it starts exit at once
        (:mod:`scheduler.slurm_marks`)."""
        if not self.slurm.requeue:
            return
        for w in workers:
            path = forgotten_mark(self._requeue_mark(job_id), int(w.split("/")[1]))
            try:
                with open(path, "a"):
                    pass
            except OSError as e:  # (its copy would register over its replacement's name)
                log.warning("could not mark %s as restarted elsewhere (%s): %s", w, path, e)

    def _requeue_mark(self, job_id: str) -> str:
        """Tracked job ``job_id``'s requeue mark (what its script exports to its tasks)."""
        group = self._jobs[job_id]
        return requeue_mark_prefix(os.path.dirname(group.log_paths[0]), group.kind) + job_id

    def _het_siblings(self, job_id: str) -> list[str]:
        """The other components of ``job_id``'s heterogeneous job still tracked ([] for a
        plain job)."""
        if "+" not in job_id:
            return []
        leader = het_leader(job_id)
        return [j for j in self._jobs if j != job_id and "+" in j and het_leader(j) == leader]

    def preempted(self, name: str) -> bool:
        """Whether worker ``name``'s job is marked for a requeue (its worker got SIGUSR2 and
        stops): until the job is requeued, a heartbeat that expires is the requeue under way,
        not a death."""
        return any(name in self._live(j)[0] and os.path.exists(self._requeue_mark(j))
                   for j in self._jobs)

    def _live(self, job_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The workers of job ``job_id`` and their logs, but those :meth:`stop_worker` forgot."""
        group, gone = self._jobs[job_id], self._forgotten.get(job_id, set())
        pairs = [(w, p) for w, p in zip(group.worker_names(), group.log_paths) if w not in gone]
        return tuple(w for w, _ in pairs), tuple(p for _, p in pairs)

    def _forget(self, ids: list[str]) -> None:
        for j in ids:
            del self._jobs[j]
            self._forgotten.pop(j, None)
            self._updates.forget(j)
        self._last_poll = 0.0

    def _cancel(self, ids: list[str], grace: float, what: str) -> None:
        """:meth:`_terminate` ``ids`` (SIGTERM, or a pending job cancelled outright), then
        plain ``scancel`` until they are gone (SchedulerError naming ``what`` if they are
        not)."""
        if not ids:
            return
        self._terminate(ids, grace)
        left = cancel_until_gone(ids, time.monotonic() + self.cancel_deadline,
                                 self.scancel_timeout)
        if left:
            raise SchedulerError(f"{what} still in the queue {self.cancel_deadline:.0f}s after "
                                 f"scancel: {', '.join(left)}")

    def _terminate(self, ids: list[str], grace: float) -> None:
        """SIGTERM to those of ``ids`` that run, and ``grace`` seconds for them to leave; the
        pending ones (requeued, suspended) are cancelled outright: they cannot take a signal,
        and ``scancel --signal`` retried on them for a minute, leaving them queued (each
        recovery after a requeue stalled 30 s on it)."""
        in_queue = queued(ids, self.scancel_timeout)
        pending = [j for j in ids if in_queue is not None
                   and in_queue.get(j) in (JobState.PENDING, JobState.REQUEUED)]
        if pending:
            scancel(pending, timeout=self.scancel_timeout)
        running = [j for j in ids if j not in pending  # those that ended need no signal
                   and (in_queue is None or j in in_queue)]
        terminate(running, grace, self.scancel_timeout)
