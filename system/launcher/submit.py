"""The launcher's other ways out: ``--dry-run`` / ``--test-only`` show every job and submit
nothing; ``--detach`` submits the controller itself as a Slurm job and returns, unless a
controller job of the trial is still in the queue."""
from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Collection, Sequence

from scheduler.base import Scheduler
from scheduler.slurm import ControllerRequest, SlurmRequest, SlurmScheduler
from scheduler.slurm_jobs import NamedJob, named_jobs
from scheduler.slurm_render import job_name, render_controller_script
from system.launcher.config import ExperimentConfig
from system.launcher.groups import group_specs
from system.launcher.self_requeue import requeues
from system.launcher.status_file import write_pending
from system.launcher.trial_lock import TrialLock
from system.errors import SchedulerError
from system.paths import TrialPaths


def dry_run(cfg: ExperimentConfig, paths: TrialPaths, scheduler: Scheduler, resolved: str,
            test_only: bool) -> int:
    """Print the resolved config and every job script (Slurm, written under ``jobs/``) or
    command (local); with ``test_only`` check each with ``sbatch --test-only`` and run the
    launch's pre-flight (:meth:`Scheduler.preflight`). Submits nothing; exit code 1 if a script
    was rejected or the pre-flight refused."""
    print(resolved)
    ok = True
    groups = [g for g in group_specs(cfg, paths, scheduler.python).values() if g.count]
    for request in scheduler.plan_all(groups):
        kinds = "+".join(g.kind for g in request.members())
        where = f" ({request.write()})" if isinstance(request, SlurmRequest) else ""
        print(f"# ---- {kinds}{where} ----\n{request.materialize()}")
        if test_only:
            assert isinstance(request, SlurmRequest), "--test-only needs scheduler=slurm"
            good, out = SlurmScheduler.test_only(request)
            ok &= good
            print(f"# sbatch --test-only: {'ok' if good else 'REJECTED'}: {out}\n")
    if test_only:  # the whole pre-flight, as a launch would run it (co-scheduling too)
        try:
            scheduler.preflight(groups)
            print("# pre-flight: ok")
        except SchedulerError as e:
            ok = False
            print(f"# pre-flight: REFUSED: {e}")
    print(f"dry run: nothing submitted; trial directory {paths.root}", file=sys.stderr)
    return 0 if ok else 1


def controller_request(cfg: ExperimentConfig, paths: TrialPaths, scheduler: SlurmScheduler,
                       argv: list[str]) -> ControllerRequest:
    """The job that runs the controller itself (``system.launch argv``) on a CPU node (pure).
    ConfigError for a controller that requeues itself with a time limit within its warning."""
    if requeues(cfg):
        scheduler.slurm.check_time_limit("controller")
    script = render_controller_script(
        exp=cfg.exp, trial=cfg.trial, slurm=scheduler.slurm,
        argv=[scheduler.python, "-m", "system.launch",  # (a key is given once)
              *[a for a in argv if not a.startswith("controller.progress=")],
              "controller.progress=false"],
        env={"PYTHONUNBUFFERED": "1"}, logs_dir=paths.logs, workdir=scheduler.workdir,
        umask=scheduler.umask, requeue=requeues(cfg))
    groups = group_specs(cfg, paths, scheduler.python)
    return ControllerRequest(groups["master"],
                             os.path.join(paths.root, "jobs", "controller.sbatch"), script)


def detach(cfg: ExperimentConfig, paths: TrialPaths, scheduler: Scheduler, argv: list[str],
           lock: TrialLock) -> int:
    """Submit the controller itself as a CPU job running ``system.launch argv`` and return;
    print how to follow, list and stop the trial. The trial's lock passes to that job: this
    process lets it go just before submitting. Refused while an earlier ``--detach``'s
    controller job is still queued (:func:`queued_controller`: it holds no lock yet, and only
    one of the two could ever run): the launcher looks before the trial's directory is
    touched, and this looks again under the lock. A Ctrl-C while submitting cancels the job."""
    assert isinstance(scheduler, SlurmScheduler), "--detach needs scheduler=slurm"
    request = controller_request(cfg, paths, scheduler, argv)
    queued = queued_controller(cfg, paths, scheduler.scancel_timeout)  # again, under the lock:
    if queued is not None:  # one submitted since the launcher's own look
        print(f"error: {refusal(cfg, queued)}", file=sys.stderr)
        return 1
    lock.release()
    since = time.time()
    try:
        job_id = scheduler.schedule(request)[0]
    except KeyboardInterrupt:  # (held during sbatch: the job id is recorded) nothing would
        scheduler.stop_all(0.0)  # ever cancel the controller job: this Ctrl-C does
        print("interrupted: the controller's job was cancelled", file=sys.stderr)
        return 1
    write_pending(cfg, paths, job_id, since)
    groups = group_specs(cfg, paths, scheduler.python)
    kinds = ("controller", "master", *(k for k in groups if k != "master"))
    print(f"submitted the controller of {cfg.exp}/{cfg.trial} as job {job_id}\n"
          f"  follow:  tail -f {shlex.quote(os.path.join(paths.logs, 'controller.log'))}\n"
          f"  jobs:    squeue -n {','.join(job_name(cfg.exp, cfg.trial, k) for k in kinds)}\n"
          f"  result:  {shlex.quote(paths.summary)}\n"
          f"  status:  python -m system.ctl status {_trial_args(cfg)}\n"
          f"  stop:    python -m system.ctl cancel {_trial_args(cfg)}   (or: scancel {job_id}; "
          "the controller then cancels every worker job)")
    return 0


LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
               "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED")
"""Slurm states of a controller job that runs, or will: not ``COMPLETING`` (its controller
has exited and let the trial's lock go)."""


def live_controller(jobs: Sequence[NamedJob], name: str,
                    logs: Collection[str]) -> NamedJob | None:
    """The first of ``jobs`` (this user's queue) that is a controller of this trial, pure: named
    ``name`` (``<exp>_<trial>:controller``), in a :data:`LIVE_STATES` state, writing one of
    ``logs`` (its ``controller.log``; a trial of the same name under another file root writes
    another). Slurm 22.05 shows the ``--output`` pattern, ``%`` doubled; later ones the path."""
    paths = {p for log in logs for p in (os.path.normpath(log),
                                         os.path.normpath(log).replace("%", "%%"))}
    return next((j for j in jobs if j.name == name and j.state in LIVE_STATES
                 and os.path.isabs(j.stdout) and os.path.normpath(j.stdout) in paths), None)


def queued_controller(cfg: ExperimentConfig, paths: TrialPaths,
                      timeout: float) -> NamedJob | None:
    """A controller job of this trial directory still queued or running (an earlier
    ``--detach`` whose job has not started yet holds no lock); None also when squeue did not
    answer (then this launch goes on, as it did before this check)."""
    name = job_name(cfg.exp, cfg.trial, "controller")
    jobs = named_jobs(name, timeout)
    log = os.path.join(paths.logs, "controller.log")
    return live_controller(jobs or [], name,
                           {log, os.path.join(os.path.realpath(paths.logs), "controller.log")})


def refusal(cfg: ExperimentConfig, job: NamedJob) -> str:
    """One line: which controller job is still queued, and how to cancel it."""
    return (f"{cfg.exp}/{cfg.trial} already has its controller in the Slurm queue (job "
            f"{job.job_id}, {job.state}); nothing was submitted; wait for it to end, or cancel "
            f"it first: python -m system.ctl cancel {_trial_args(cfg)} (or: scancel "
            f"{job.job_id})")


def _trial_args(cfg: ExperimentConfig) -> str:
    """``exp=E trial=T cluster.fileroot=DIR``, quoted for a shell."""
    return shlex.join([f"exp={cfg.exp}", f"trial={cfg.trial}",
                       f"cluster.fileroot={os.path.abspath(cfg.cluster.fileroot)}"])
