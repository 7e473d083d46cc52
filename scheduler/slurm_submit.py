"""``sbatch`` of one job, and taking a job Slurm queued though ``sbatch`` timed out.

An ``sbatch`` whose request Slurm's controller did not answer in time (overloaded, stalled:
``Socket timed out on send/recv operation``) gives up, but the controller may still take the
request once it answers: the job is queued and nobody tracks it (it ran until its workers judged
their controller gone; a recovery that went on submitted the group again beside it). So after
such a time-out the queue is searched, for :data:`ADOPT_WAIT` seconds, for a job of that name
writing its batch log where this one would, and one found is taken as if ``sbatch`` had named
it; a name not found then is looked for again before it is next submitted
(:class:`Submitter`). An ``sbatch`` that could not connect at all sent nothing."""
from __future__ import annotations

import logging
import time
from typing import Callable, Collection

from scheduler.slurm_cli import (ENDING_STATES, QUEUED_STATES, last_error,
                                 parse_sbatch_parsable, unreachable)
from scheduler.slurm_cli import run as _run
from scheduler.slurm_jobs import cancel_until_gone, het_leader, named_jobs, writes_in
from system.errors import SchedulerError
from system.held_signals import held_signals

log = logging.getLogger("slurm")

ADOPT_WAIT = 30.0
"""Seconds the queue is searched for a job a timed-out ``sbatch`` may have queued."""

CANCEL_WAIT = 60.0
"""Seconds the cancel of such a job's copies is retried (a stalled slurmctld made them)."""
LOOK_EVERY = 2.0
QUERY_TIMEOUT = 15.0


class SubmitUnconfirmed(SchedulerError):
    """``sbatch`` timed out waiting for Slurm's answer: the job may be queued all the same."""


def sbatch(path: str, what: str) -> str:
    """``sbatch --parsable`` the script at ``path`` (``what``: the job, for messages); its id.
    :class:`SubmitUnconfirmed` after a time-out, SchedulerError for any other failure."""
    try:
        r = _run(["sbatch", "--parsable", path])
    except SchedulerError as e:
        if "did not answer" not in str(e):  # (sbatch not found)
            raise
        raise SubmitUnconfirmed(_unreachable(what, str(e))) from None
    if r.returncode == 0:
        return parse_sbatch_parsable(r.stdout)
    why = last_error(r)
    if not unreachable(r):
        raise SchedulerError(f"sbatch refused the job of {what}: {why} (script: {path})")
    if "socket timed out" in why.lower():  # (sent; "connection timed out": never sent)
        raise SubmitUnconfirmed(_unreachable(what, why))
    raise SchedulerError(_unreachable(what, why))


def _unreachable(what: str, why: str) -> str:
    return (f"sbatch could not reach Slurm's controller to submit {what}: {why} (is slurmctld "
            "up, and this node's Slurm configuration readable? `scontrol ping` tells)")


def queued_as(name: str, logs_dir: str, known: Collection[str],
              timeout: float = QUERY_TIMEOUT) -> list[str] | None:
    """Ids (leaders) of this user's queued jobs named ``name`` whose batch log is in
    ``logs_dir``, but ``known`` ones (every job the trial had: a group's job cancelled for a
    recovery may still be completing) and ending ones, the one to take last: pending ones
    before running ones (whose workers may have registered), each oldest first; None when
    squeue does not answer."""
    jobs = named_jobs(name, timeout)
    if jobs is None:
        return None
    known = {het_leader(k) for k in known}  # (a het job's components, or its leader)
    found: dict[str, bool] = {}  # leader -> running
    for j in jobs:
        leader = het_leader(j.job_id)
        if (j.name == name and j.state in QUEUED_STATES - ENDING_STATES
                and writes_in(j, [logs_dir]) and leader not in known):
            found[leader] = found.get(leader, False) or j.state == "RUNNING"
    return sorted(found, key=lambda j: (found[j], len(j), j))


def cancel_copies(ids: list[str], what: str) -> None:
    """Cancel jobs queued for ``what`` by an earlier ``sbatch`` that timed out, besides the
    one taken or submitted (two time-outs in a row, each queued after all: copies of the same
    workers, untracked)."""
    log.warning("jobs %s, also queued for %s by an earlier sbatch that timed out: cancelled",
                ",".join(ids), what)
    left = cancel_until_gone(ids, time.monotonic() + CANCEL_WAIT, QUERY_TIMEOUT)
    if left:  # (recorded nowhere: the trial's stop would not cancel them either)
        log.error("jobs %s, copies of %s, could not be cancelled within %.0fs: cancel them "
                  "(scancel %s)", ",".join(left), what, CANCEL_WAIT, " ".join(left))


def adopt(name: str, logs_dir: str, known: Collection[str], wait: float) -> list[str] | None:
    """The jobs queued as ``name`` (see :func:`queued_as`: the last one is to be taken),
    looked for up to ``wait`` seconds; None if none shows."""
    deadline = time.monotonic() + wait
    while True:
        found = queued_as(name, logs_dir, known)
        if found:
            return found
        if time.monotonic() >= deadline:
            return None
        time.sleep(LOOK_EVERY)


class Submitter:
    """Submits jobs, remembering the names a timed-out ``sbatch`` may have queued unseen."""

    def __init__(self) -> None:
        self.unconfirmed: set[str] = set()

    def submit(self, path: str, what: str, name: str, logs_dir: str, known: Collection[str],
               record: Callable[[str], list[str]]) -> list[str]:
        """``sbatch`` the script at ``path`` and ``record`` the job id (signals held meanwhile:
        a Ctrl-C is acted on once the id is recorded). A job of ``name`` an earlier time-out
        may have queued is taken instead, if queued; after a time-out of this ``sbatch`` the
        queue is searched (:func:`adopt`, signals acted on) before SubmitUnconfirmed."""
        if name in self.unconfirmed:
            found = queued_as(name, logs_dir, known)
            if found:
                self.unconfirmed.discard(name)
                log.warning("job %s (%s), queued though its sbatch timed out, is taken as %s",
                            found[-1], name, what)
                return self._take(found, what, record)
        try:
            with held_signals():
                ids = record(sbatch(path, what))
            if name in self.unconfirmed:
                self._sweep(name, logs_dir, [*known, *ids], what)
            return ids
        except SubmitUnconfirmed:
            found = adopt(name, logs_dir, known, ADOPT_WAIT)
            if found is None:
                self.unconfirmed.add(name)
                raise
        log.warning("sbatch of %s timed out, but Slurm queued it as job %s: taken", what,
                    found[-1])
        return self._take(found, what, record)

    @staticmethod
    def _take(found: list[str], what: str, record: Callable[[str], list[str]]) -> list[str]:
        """Record the last of ``found`` (signals held), then cancel the others: the job taken
        is never left unrecorded while they are (a stop meanwhile cancels it)."""
        with held_signals():
            ids = record(found[-1])
        if len(found) > 1:
            cancel_copies(found[:-1], what)
        return ids

    def _sweep(self, name: str, logs_dir: str, known: Collection[str], what: str) -> None:
        """``sbatch`` of ``name`` went through while an earlier one's job was not found (the
        queue did not answer, or Slurm had not queued it yet): once Slurm answers, a late
        copy is cancelled; the name is forgotten once the queue answered without one."""
        found = queued_as(name, logs_dir, known)
        if found is None:
            return
        if found:
            cancel_copies(found, what)
        self.unconfirmed.discard(name)
