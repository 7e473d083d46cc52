"""The scheduler interface: plan (pure) and schedule worker groups, report states, stop all.

As in TorchX, ``submit = schedule(plan(group))``: :meth:`Scheduler.plan` returns a
:class:`JobRequest` whose :meth:`~JobRequest.materialize` is the script or command text (what
``--dry-run`` shows); only :meth:`Scheduler.schedule` and the ``stop_*`` methods act.
"""
from __future__ import annotations

import abc
import dataclasses
import sys
from typing import Callable, Collection, Mapping, Sequence

from scheduler.jobs import JobState, JobStatus
from scheduler.requeue import RequeuePolicy

__all__ = ["GroupSpec", "JobRequest", "JobState", "JobStatus", "RequeuePolicy", "Scheduler"]


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Workers ``first .. first+count-1`` of group ``kind``, each a process running ``argv``;
    worker ``first + i`` logs to ``log_paths[i]``. The whole group has ``first == 0``; a
    recovery that restarts one worker alone submits ``first=index, count=1``. The worker index
    is added by the scheduler (local: ``--index``; Slurm: each task derives it from its
    environment, its rank plus ``RLSYS_WORKER_BASE``)."""

    kind: str
    count: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_paths: tuple[str, ...]
    first: int = 0
    """Index of the first worker (0 for a whole group)."""

    def __post_init__(self) -> None:
        if self.first < 0 or len(self.log_paths) != self.count:
            raise ValueError(f"{self.kind} group: first={self.first} with {self.count} workers "
                             f"and {len(self.log_paths)} log paths")

    def worker_names(self) -> tuple[str, ...]:
        """``kind/first`` .. ``kind/first+count-1``, in the order of :attr:`log_paths`."""
        return tuple(f"{self.kind}/{self.first + i}" for i in range(self.count))


class JobRequest(abc.ABC):
    """What :meth:`Scheduler.schedule` will submit; ``materialize()`` is its text."""

    group: GroupSpec

    @abc.abstractmethod
    def materialize(self) -> str: ...

    def members(self) -> tuple[GroupSpec, ...]:
        """The groups this request starts (one, but for a Slurm heterogeneous job); its
        :meth:`Scheduler.schedule` returns one job id per member, in this order."""
        return (self.group,)


class Scheduler(abc.ABC):
    """Starts, watches and stops the jobs of one trial; says which python runs the workers and
    how requeued jobs are treated (:meth:`requeue_policy`)."""

    @property
    def python(self) -> str:
        """The python executable that runs the workers (default: the launcher's own)."""
        return sys.executable

    def requeue_policy(self) -> RequeuePolicy:
        """A fresh requeue/rejoin bookkeeping for one trial (default: jobs are never requeued)."""
        return RequeuePolicy()

    @abc.abstractmethod
    def plan(self, group: GroupSpec) -> JobRequest:
        """Pure: the request that would start ``group``."""

    @abc.abstractmethod
    def schedule(self, request: JobRequest) -> list[str]:
        """Start the request's workers; returns job ids."""

    def submit(self, group: GroupSpec) -> list[str]:
        return self.schedule(self.plan(group))

    def plan_all(self, groups: Sequence[GroupSpec]) -> list[JobRequest]:
        """Pure: the requests that start every group of ``groups`` (default: one each)."""
        return [self.plan(g) for g in groups]

    def preflight(self, groups: Sequence[GroupSpec]) -> None:
        """Before anything is submitted: raise SchedulerError (one line naming the groups and
        the keys to change) if ``groups`` can never run, alone or together (default: no
        check)."""

    def submit_all(self, groups: Sequence[GroupSpec],
                   waiting: Callable[[], None] | None = None) -> dict[str, list[str]]:
        """Start every group of ``groups``; returns their job ids by kind. ``waiting`` is
        called often while a scheduler waits before starting a group (a warm spare's imports:
        the caller's look at a stop request), and may raise to end the wait."""
        out: dict[str, list[str]] = {}
        for request in self.plan_all(groups):
            ids = self.schedule(request)
            members = request.members()
            if len(members) == 1:
                out[members[0].kind] = ids
            else:
                out.update({g.kind: [j] for g, j in zip(members, ids)})
        return out

    @abc.abstractmethod
    def poll(self, fresh: bool = False) -> list[JobStatus]:
        """Current state of every job submitted so far (``fresh``: bypass any caching)."""

    @abc.abstractmethod
    def stop_all(self, grace: float) -> None:
        """Stop every job of the trial; must leave nothing running or queued."""

    @abc.abstractmethod
    def stop_group(self, kind: str, grace: float) -> None:
        """Stop every worker of group ``kind`` and forget its jobs (the group may then be
        submitted again, as a recovery does); must leave none of them running or queued."""

    def cancel_leftovers(self, logs_dirs: Sequence[str]) -> list[str]:
        """Cancel the jobs of this trial, writing their logs in one of ``logs_dirs``, that an
        earlier run's controller left behind when it died (the caller holds the trial's lock:
        any such job is a leftover); their ids. Default: none (the local scheduler's workers
        are this process's children, killed with it)."""
        return []

    def warm_spares(self, start_wait: float = 0.0) -> None:
        """From now on keep warm spare processes that a restart can take over, where this
        scheduler has any (default: none). Asked before :meth:`submit_all` with ``start_wait``
        > 0, they start the trial's workers too, each group's waited for up to that long."""

    def preempted(self, name: str) -> bool:
        """Whether worker ``name`` is stopping for a requeue of its job (a scheduler without
        requeues: never)."""
        return False

    def dump_stacks(self, workers: Collection[str]) -> list[str]:
        """Ask the running processes of ``workers`` (``kind/index``, each past its start: it
        registered) to write every thread's stack to their logs and go on
        (:data:`~system.thread_stacks.STACKS_SIGNAL`); what was signalled (pids, job ids).
        Nothing is stopped. Default: nothing to ask."""
        return []

    @abc.abstractmethod
    def stop_worker(self, name: str, grace: float) -> None:
        """Stop worker ``name`` (``kind/index``) and forget it, so it may be submitted again
        alone (a recovery restarts a dead stateless worker by itself); must leave it neither
        running nor queued. The other workers of its group are left alone; an unknown (or
        already forgotten) worker is nothing to do."""
