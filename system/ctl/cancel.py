"""``cancel``: stop every job and process of a trial, within :data:`DEADLINE` seconds.

1. Record the request (``cancel.json``: who, when) and set the trial's cancel key in name
   resolution: the running controller sees it within a second and stops the trial as for
   Ctrl-C (workers told to stop, jobs cancelled), recording it as ``cancelled``. A detached
   controller still queued is cancelled with ``scancel`` (it never ran a worker).
2. A controller that has not stopped within half of :data:`GRACE` gets SIGTERM (its pid on this
   host, checked through ``/proc``) or ``scancel`` (its ``--detach`` job).
3. Whatever is left after :data:`GRACE` is stopped here: every queued job of the trial
   (recorded ids, and this user's jobs named ``<exp>_<trial>:*`` whose output, squeue's
   ``StdOut``, lies under the trial directory: a trial of the same name under another file
   root is not this one) with ``scancel`` until ``squeue`` lists none; every local worker or
   spare (``--trial-dir <trial dir>`` on its command line) and the launcher (if its command
   line is this trial's) with SIGTERM, then SIGKILL. A controller that could not write its
   last record gets one written here.
"""
from __future__ import annotations

import getpass
import os
import signal
import socket
import time
from typing import Any, Iterable, Sequence

from scheduler.slurm_jobs import NamedJob, stdout_under
from system.cli_entry import INTERRUPTED
from system.ctl import output, procs, slurm_query
from system.ctl.live import request_cancel
from system.ctl.trial_state import TrialView, read_trial
from system.launcher.status_file import FINAL_STATES
from system.launcher.trial_dir import now_iso, write_json_atomic
from system.paths import TrialPaths

GRACE = 20.0
"""Seconds the controller is given to stop the trial itself."""
DEADLINE = 30.0
"""Seconds after which ``cancel`` gives up and reports what is left."""


def _say(t0: float, text: str) -> None:
    output.say(f"[{time.monotonic() - t0:5.1f}s] {text}")


def _request(view: TrialView) -> str:
    """Write ``cancel.json`` and the cancel key; returns why the key could not be set."""
    note = {"time": time.time(), "user": getpass.getuser(), "host": socket.gethostname(),
            "pid": os.getpid()}
    write_json_atomic(view.paths.cancel_request, note)
    return request_cancel(view.paths, view.exp, view.trial, str(note))


def _signal_controller(view: TrialView, t0: float) -> None:
    """A ``--detach`` controller's own job is cancelled; a launcher on this machine gets
    SIGTERM. A launcher elsewhere is only named, with the Slurm job it runs in, if any: that
    job is the user's allocation (``salloc``, a wrapper script), not the trial's to cancel."""
    holder = view.holder or {}
    job = view.controller_job()
    if job:
        slurm_query.scancel([job])
        _say(t0, f"scancel {job} (the controller's job)")
        return
    pid = procs.launcher_here(holder, view.exp, view.trial)
    if pid:
        os.kill(pid, signal.SIGTERM)
        _say(t0, f"SIGTERM to the controller (pid {pid})")
        return
    inside = str(holder.get("slurm_job") or "")
    _say(t0, f"cannot signal the controller (pid {holder.get('pid') or 0} on "
             f"{holder.get('host')!r})"
         + (f"; it runs inside Slurm job {inside}, which `scancel {inside}` would end with "
            "everything else in it" if inside else ""))


def _wait_controller(view: TrialView, t0: float, grace: float, signalled: bool) -> TrialView:
    """Until no process holds the trial's lock, or ``grace`` seconds since ``t0``; the
    controller is signalled once half of it has passed, unless it was already or it has
    recorded that it is stopping."""
    seen = False
    while True:
        view = read_trial(view.paths)
        if view.holder is None and view.state != "pending":
            return view
        if not seen and view.record.get("state") == "stopping":
            seen = True
            _say(t0, "the controller is stopping the trial")
        elapsed = time.monotonic() - t0
        if elapsed >= grace:
            return view
        if not (signalled or seen) and elapsed >= grace / 2:
            _signal_controller(view, t0)
            signalled = True
        time.sleep(0.25)


def named_here(jobs: Sequence[NamedJob], exp: str, trial: str,
               roots: Iterable[str]) -> list[str]:
    """Those of ``jobs`` (this user's queue) named ``<exp>_<trial>:*`` whose output lies under
    one of ``roots`` (the trial directory, as written and resolved), pure: another trial of the
    same name under another file root writes elsewhere, and is not this trial's."""
    prefix = f"{exp}_{trial}:"
    named = [j for j in jobs if j.name.startswith(prefix)]
    here = {j.job_id for j in named if any(stdout_under(j.stdout, r) for r in roots)}
    # a heterogeneous job's components go with the one that names its output (component 0
    # alone has --output in the script: the others may show none)
    leaders = {job_id.split("+")[0] for job_id in here if "+" in job_id}
    return sorted(here | {j.job_id for j in named
                          if "+" in j.job_id and j.job_id.split("+")[0] in leaders})


def _recorded_jobs(view: TrialView) -> list[str]:
    ids = {str(j["id"]) for j in view.record.get("jobs") or []}
    ids.add(view.controller_job())
    return sorted(i for i in ids if i)


def _trial_jobs(view: TrialView) -> list[str] | None:
    """Queued jobs of the trial: its recorded ones, and this user's named ``<exp>_<trial>:*``
    that write their output under the trial directory (:func:`named_here`); None when
    ``squeue`` did not answer (which is not "none")."""
    queued = slurm_query.queue(_recorded_jobs(view))
    named = None if queued is None else slurm_query.mine()  # (each may wait its time-out)
    if queued is None or named is None:
        return None
    roots = {view.paths.root, os.path.realpath(view.paths.root)}
    return sorted(set(queued) | set(named_here(named, view.exp, view.trial, roots)))


def _sweep_slurm(view: TrialView, t0: float, deadline: float) -> list[str] | None:
    """``scancel`` the trial's queued jobs until none is left or ``deadline``; the ids left,
    None when ``squeue`` never answered (its recorded jobs are cancelled meanwhile, blindly)."""
    left = _trial_jobs(view)
    if left is None:
        _say(t0, "squeue does not answer: cancelling the trial's recorded jobs blindly")
    elif left:
        _say(t0, f"scancel {' '.join(left)}")
    tries = 0
    while (left is None or left) and (time.monotonic() < deadline or not tries):
        slurm_query.scancel(_recorded_jobs(view) if left is None else left)
        tries += 1
        time.sleep(1.0)
        left = _trial_jobs(view)
    return left


def _sweep_local(view: TrialView, t0: float) -> list[int]:
    """Stop the trial's workers and spares on this machine, and its launcher; pids left."""
    pids = procs.trial_processes(view.paths.root)
    pid = procs.launcher_here(view.holder, view.exp, view.trial)
    if pid:
        pids.append(pid)
    if pids:
        _say(t0, f"stopping processes {' '.join(map(str, pids))}")
    return procs.terminate(pids, 3.0)


def _final_record(paths: TrialPaths, t0: float) -> None:
    """The controller died before its last record: write one (state ``cancelled``), and the
    run's ``summary.json`` (a launch removes the previous run's, so none is there)."""
    view = read_trial(paths)
    if str(view.record.get("state")) in FINAL_STATES or not view.record:
        return
    jobs = [{**j, "state": "CANCELLED"} for j in view.record.get("jobs") or []]
    now = time.time()
    write_json_atomic(paths.status, {**view.record, "state": "cancelled", "jobs": jobs,
                                     "phase": "stopped by system.ctl cancel", "updated": now})
    wrote = ""
    if not os.path.exists(paths.summary):
        write_json_atomic(paths.summary, lost_summary(view.record, now))
        wrote = " and summary.json"
    elif (view.summary or {}).get("status") == "requeued":  # its controller's job, cancelled
        write_json_atomic(paths.summary, {**(view.summary or {}), "status": "cancelled"})
        wrote = " and summary.json"
    verb = "say" if wrote else "says"
    _say(t0, f"the controller left no final record: status.json{wrote} now {verb} cancelled")


def lost_summary(record: dict[str, Any], now: float) -> dict[str, Any]:
    """A ``summary.json`` for a run whose controller died before writing one, from its last
    ``status.json`` record (pure)."""
    started = float(record.get("started") or 0.0)
    progress = record.get("progress") or {}
    return {"exp": record.get("exp"), "trial": record.get("trial"), "status": "cancelled",
            "scheduler": record.get("scheduler"), "name_resolve": record.get("name_resolve"),
            "workers": record.get("workers"),
            "start_time": now_iso(started) if started else None, "end_time": now_iso(now),
            "t0_epoch": started or None,
            "failure": {"message": "the controller stopped without a final record (killed, or "
                                   "its host lost); system.ctl cancel stopped what was left",
                        "worker": None, "log": None},
            "last_progress": progress, "written_by": "system.ctl cancel"}


def run(paths: TrialPaths, grace: float = GRACE) -> int:
    t0 = time.monotonic()
    view = read_trial(paths)
    if view.live:
        why = _request(view)
        _say(t0, f"cancel requested for {view.exp}/{view.trial} ({view.state})"
             + (f"; the cancel key could not be set: {why}" if why else ""))
        signalled = bool(why) or (view.state == "pending" and bool(view.controller_job()))
        try:
            if signalled:  # no key to see, or a controller still queued (it never ran a worker)
                _signal_controller(view, t0)
            view = _wait_controller(view, t0, grace, signalled)
        except KeyboardInterrupt:
            _say(t0, "interrupted: " + (
                "the cancel key stands: the controller stops the trial when it reads it "
                "(`python -m system.ctl status` shows when it has)" if not why else
                "the controller may still run: cancel again"))
            return INTERRUPTED
        if view.holder is None:
            _say(t0, f"the controller has stopped; trial {view.state}")
        else:
            _say(t0, "the controller did not stop in time: stopping the trial's jobs here")
    elif view.other_run is not None:  # (its processes are not this run's: left alone)
        _say(t0, f"{view.exp}/{view.trial} is {view.state}, but {view.other_line()}: cancel "
             "that run with the same words and mode="
             f"{view.other_run.get('mode', 'train')}")
        return 1
    else:
        _say(t0, f"{view.exp}/{view.trial} is {view.state}; checking that nothing is left")
    deadline = t0 + DEADLINE
    jobs_left = _sweep_slurm(view, t0, deadline) if view.scheduler == "slurm" else []
    pids_left = _sweep_local(view, t0)
    if jobs_left is None:  # (it said "nothing is left", exit 0, and recorded "cancelled")
        _say(t0, "Slurm did not answer squeue: whether jobs of the trial are left is unknown; "
             "cancel again once it answers (`scontrol ping` tells)")
        return 1
    _final_record(paths, t0)
    if jobs_left or pids_left:
        _say(t0, f"still there: jobs {jobs_left or 'none'}, processes {pids_left or 'none'}")
        return 1
    _say(t0, f"nothing of {view.exp}/{view.trial} is left"
         + (" (squeue lists none of its jobs)" if view.scheduler == "slurm" else
            " (no process of it runs here)"))
    return 0
