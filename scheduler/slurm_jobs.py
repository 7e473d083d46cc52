"""Slurm's job commands the scheduler runs on job ids: look a job up (``scontrol``), which are
still queued (``squeue``), signal and cancel them (``scancel``), never requeue one.

Plain functions over ids: the scheduler keeps which jobs are its own. A command that does not
answer within ``timeout`` seconds, or fails, is logged and reported as "no news" (``None``),
never raised: a busy slurmctld may not answer for a minute, and callers look again.
A heterogeneous job's component ``<job>+<offset>`` is named by its leader where Slurm wants the
whole job (squeue, scancel, scontrol update).
"""
from __future__ import annotations

import dataclasses
import getpass
import logging
import os
import time
from typing import Collection

from scheduler.base import JobState
from scheduler.slurm_cli import map_state, parse_scontrol_job
from scheduler.slurm_cli import run as _run
from system.errors import SchedulerError

log = logging.getLogger("slurm")


def het_leader(job_id: str) -> str:
    """``"12+1"`` (component 1 of heterogeneous job 12) -> ``"12"``; a plain id as it is."""
    return job_id.split("+")[0]


def scontrol_job(job_id: str, timeout: float = 60) -> dict[str, str]:
    """``scontrol show job`` of ``job_id`` (a heterogeneous job's component: its line);
    SchedulerError when scontrol does not answer within ``timeout`` seconds."""
    leader, _, offset = job_id.partition("+")
    r = _run(["scontrol", "show", "job", "-o", leader], timeout=timeout)
    if r.returncode != 0 or not r.stdout.strip():
        return {}
    lines = [parse_scontrol_job(line) for line in r.stdout.strip().splitlines()]
    if offset:
        lines = [kv for kv in lines if kv.get("HetJobOffset") == offset]
    return lines[0] if lines else {}


PREEMPT_RECENT = 120.0
"""Seconds after its ``PreemptTime`` during which a SIGTERM counts as that preemption's: a grace
preemption signals the tasks at once, and Slurm keeps the time after a gang suspension too."""


def preempting(job_id: str, timeout: float = 3.0) -> bool:
    """Whether Slurm has just chosen ``job_id`` for preemption (``PreemptTime`` within
    :data:`PREEMPT_RECENT` seconds): on a cluster with ``PreemptMode=REQUEUE`` and a
    ``GraceTime``, a preempted job's tasks get SIGTERM, not the job's ``--signal``, and the job
    is requeued only if it still runs when the grace ends. False when scontrol does not say
    within ``timeout`` (no news is not a preemption)."""
    try:
        when = preempt_time(scontrol_job(job_id, timeout))
    except SchedulerError as e:
        log.warning("%s", e)
        return False
    return when is not None and abs(time.time() - when) <= PREEMPT_RECENT


def preempt_time(job: dict[str, str]) -> float | None:
    """The unix time of a job's ``PreemptTime`` (``scontrol show job``, local time), or None
    (``None``, ``Unknown``, absent: never chosen for preemption) (pure but for the zone)."""
    return job_time(job, "PreemptTime")


def job_time(job: dict[str, str], key: str) -> float | None:
    """The unix time of a time field of ``scontrol show job`` (``StartTime``, ``EndTime``...,
    local time), or None (``None``, ``Unknown``, absent) (pure but for the zone)."""
    try:
        return time.mktime(time.strptime(job.get(key, "None"), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def scontrol_partition(partition: str, timeout: float = 3.0) -> dict[str, str]:
    """``scontrol show partition`` of ``partition`` (its ``GraceTime``, ``PreemptMode``...);
    empty when scontrol fails, SchedulerError when it does not answer within ``timeout``."""
    r = _run(["scontrol", "show", "partition", "-o", partition], timeout=timeout)
    return parse_scontrol_job(r.stdout) if r.returncode == 0 else {}


def queued(ids: list[str], timeout: float) -> dict[str, JobState] | None:
    """``{job id: state}`` of those of ``ids`` still in the queue (pending, running,
    completing); ``None`` when squeue did not answer (no news is not an empty queue)."""
    if not ids:
        return {}
    try:
        r = _run(["squeue", "-h", "-j", ",".join(sorted({het_leader(j) for j in ids})),
                  "-o", "%i|%T"], timeout=timeout)
    except SchedulerError as e:
        log.warning("%s", e)
        return None
    if r.returncode != 0:
        if "Invalid job id" in r.stderr:  # one has left the queue (and Slurm's memory)
            return {} if len({het_leader(j) for j in ids}) == 1 else _queued_each(ids, timeout)
        log.warning("squeue failed: %s", r.stderr.strip())
        return None
    out = {}
    for line in r.stdout.splitlines():
        job_id, _, raw = line.strip().partition("|")
        state = map_state(raw)
        if job_id not in ids:  # a het job asked for by its leader: its components' lines
            job_id = het_leader(job_id)
        if job_id in ids and state.active:
            out[job_id] = state
    return out


def _queued_each(ids: list[str], timeout: float) -> dict[str, JobState] | None:
    """:func:`queued` one id at a time (squeue refuses a list naming a purged job)."""
    out: dict[str, JobState] = {}
    for job_id in ids:
        one = queued([job_id], timeout)
        if one is None:
            return None
        out.update(one)
    return out


def scancel(ids: list[str], *flags: str, timeout: float) -> None:
    """One ``scancel``; a slow or failed one is logged, never raised (the caller checks the
    queue and tries again)."""
    targets = sorted({het_leader(j) for j in ids})  # Slurm cancels a hetjob as a whole
    try:
        r = _run(["scancel", *flags, *targets], timeout=timeout)
    except SchedulerError as e:
        log.warning("%s", e)
        return
    if r.returncode != 0 and not _only_gone(r.stderr):
        log.warning("scancel %s failed: %s", " ".join([*flags, *ids]), r.stderr.strip())


def _only_gone(stderr: str) -> bool:
    """Whether ``scancel`` failed only for jobs that had already left or are leaving (cancelled
    by the user, ended): ``Invalid job id specified`` (gone from slurmctld's memory) or ``Job/step
    already completing or completed`` on every line; what is to stop is stopped."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return bool(lines) and all(any(m in ln for m in GONE_MESSAGES) for ln in lines)


GONE_MESSAGES = ("Invalid job id specified", "already completing or completed")
"""What ``scancel`` says of a job that has already ended or is ending."""


def terminate(ids: list[str], grace: float, timeout: float) -> None:
    """SIGTERM to the running jobs ``ids``; up to ``grace`` seconds for them to leave."""
    if not ids:
        return
    scancel(ids, "--signal=TERM", "--full", timeout=timeout)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and queued(ids, timeout) != {}:
        time.sleep(0.5)


def cancel_until_gone(ids: list[str], deadline: float, timeout: float) -> list[str]:
    """Plain ``scancel`` of whatever is still queued, retried with backoff (1 s doubling to
    16 s) until nothing is left or ``deadline`` (monotonic); returns the ids left."""
    left, wait = list(ids), 1.0
    while True:
        found = queued(left, timeout)
        if found is not None:
            left = [j for j in left if j in found]
            if not left:
                return []
        if time.monotonic() >= deadline:
            return left
        scancel(left, timeout=timeout)
        time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
        wait = min(wait * 2, 16.0)


@dataclasses.dataclass(frozen=True)
class NamedJob:
    """One of this user's queued jobs, found by name (``squeue -O``, :data:`NAMED_FORMAT`)."""

    job_id: str
    """``12``, or ``12+1`` for a heterogeneous job's component (as ``squeue -o %i``)."""
    state: str
    """Slurm's own state word (``PENDING``, ``RUNNING``, ``COMPLETING``, ...)."""
    name: str
    stdout: str
    """Its batch output (``StdOut``): the ``--output`` pattern as given (``%%`` for a ``%``)
    on Slurm 22.05, expanded by later versions."""


NAMED_FORMAT = "JobArrayID:0|,State:0|,Name:0|,StdOut:0"
"""Each field as wide as it needs, ended by ``|``; ``StdOut`` last, as it may hold a ``|``."""


def parse_named(out: str) -> list[NamedJob]:
    """The lines ``squeue -h -O`` :data:`NAMED_FORMAT` prints (pure)."""
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|", 3)
        if len(parts) == 4 and parts[0]:
            jobs.append(NamedJob(parts[0], parts[1].split(" ")[0], parts[2], parts[3]))
    return jobs


def stdout_under(stdout: str, root: str) -> bool:
    """Whether a job's ``StdOut`` (:attr:`NamedJob.stdout`) lies under the directory ``root``
    (pure): as Slurm expands it, or as the pattern the job scripts write (``%`` doubled,
    :func:`scheduler.slurm_render.slurm_literal`). A relative or empty one never does."""
    if not os.path.isabs(stdout) or not os.path.isabs(root):
        return False
    path = os.path.normpath(stdout)
    return any(path.startswith(os.path.join(os.path.normpath(r), "")) for r in
               {root, root.replace("%", "%%")})


def writes_in(job: NamedJob, dirs: Collection[str]) -> bool:
    """Whether ``job``'s batch log (``StdOut``) is in one of ``dirs`` (pure). Slurm 22.05 shows
    the ``--output`` pattern, ``%`` doubled; later ones the path."""
    forms = {p for d in dirs for p in (os.path.normpath(d), os.path.normpath(d).replace("%", "%%"))}
    return os.path.isabs(job.stdout) and os.path.dirname(os.path.normpath(job.stdout)) in forms


def named_jobs(name: str | None, timeout: float) -> list[NamedJob] | None:
    """This user's jobs named ``name`` (None: all of them) that the queue still holds; None
    when squeue did not answer (no news is not an empty queue), logged at debug level only:
    the caller's next Slurm command (``sbatch``) names an unreachable Slurm in its own line."""
    by_name = [] if name is None else ["-n", name]
    try:
        r = _run(["squeue", "-h", "-u", getpass.getuser(), *by_name, "-O", NAMED_FORMAT],
                 timeout=timeout)
    except SchedulerError as e:
        log.debug("%s", e)
        return None
    if r.returncode != 0:
        log.debug("squeue failed: %s", r.stderr.strip())
        return None
    return parse_named(r.stdout)


def slurm_release(job_id: str, timeout: float) -> str | None:
    """``scontrol release <job>`` (a held job becomes eligible); the error, or None."""
    try:
        r = _run(["scontrol", "release", het_leader(job_id)], timeout=timeout)
    except SchedulerError as e:
        return str(e)
    return None if r.returncode == 0 else r.stderr.strip()


def scontrol_update(job_id: str, setting: str, timeout: float) -> str | None:
    """``scontrol update JobId=<job> <setting>``; the error it gave (for the caller to log),
    or None."""
    try:
        r = _run(["scontrol", "update", f"JobId={het_leader(job_id)}", setting],
                 timeout=timeout)
    except SchedulerError as e:
        return str(e)
    return None if r.returncode == 0 else r.stderr.strip()
