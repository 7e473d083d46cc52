"""The launcher's other ways out: ``--dry-run`` / ``--test-only`` show every job and submit
nothing; ``--detach`` submits the controller itself as a Slurm job and returns."""
from __future__ import annotations

import os
import shlex
import sys
import time

from scheduler.base import Scheduler
from scheduler.slurm import ControllerRequest, SlurmRequest, SlurmScheduler
from scheduler.slurm_render import job_name, render_controller_script
from system.launcher.config import ExperimentConfig
from system.launcher.groups import group_specs
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
    """The job that runs the controller itself (``system.launch argv``) on a CPU node (pure)."""
    script = render_controller_script(
        exp=cfg.exp, trial=cfg.trial, slurm=scheduler.slurm,
        argv=[scheduler.python, "-m", "system.launch",  # (a key is given once)
              *[a for a in argv if not a.startswith("controller.progress=")],
              "controller.progress=false"],
        env={"PYTHONUNBUFFERED": "1"}, logs_dir=paths.logs, workdir=scheduler.workdir,
        umask=scheduler.umask)
    groups = group_specs(cfg, paths, scheduler.python)
    return ControllerRequest(groups["master"],
                             os.path.join(paths.root, "jobs", "controller.sbatch"), script)


def detach(cfg: ExperimentConfig, paths: TrialPaths, scheduler: Scheduler, argv: list[str],
           lock: TrialLock) -> int:
    """Submit the controller itself as a CPU job running ``system.launch argv`` and return;
    print how to follow, list and stop the trial. The trial's lock passes to that job: this
    process lets it go just before submitting."""
    assert isinstance(scheduler, SlurmScheduler), "--detach needs scheduler=slurm"
    request = controller_request(cfg, paths, scheduler, argv)
    lock.release()
    since = time.time()
    job_id = scheduler.schedule(request)[0]
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


def _trial_args(cfg: ExperimentConfig) -> str:
    """``exp=E trial=T cluster.fileroot=DIR``, quoted for a shell."""
    return shlex.join([f"exp={cfg.exp}", f"trial={cfg.trial}",
                       f"cluster.fileroot={os.path.abspath(cfg.cluster.fileroot)}"])
