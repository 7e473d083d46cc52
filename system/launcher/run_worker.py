"""Entry point of every worker process: the worker kind's class, running the role its
experiment gives that kind.

    python -m system.launcher.run_worker --trial-dir runs/smoke/t1 --kind rollout --index 3

Under Slurm the index is omitted: each task derives its worker index (global rank) and local
rank from the Slurm environment through submitit's ``JobEnvironment``, and before anything
touches CUDA sets its ranks (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...) and,
in a job that requests GPUs, narrows ``CUDA_VISIBLE_DEVICES`` to its own
(:func:`scheduler.gpu_plan.task_env`). There each task forks its witness
(:mod:`system.launcher.witness`), which vouches for its process and can end it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from scheduler.gpu_plan import task_env
from scheduler.slurm_marks import forgotten_here
from scheduler.spares import SERVES_START_ENV, STANDBY_FLAG
from system.bootstrap import Bootstrap
from system.cpu_binding import CPUS_ENV, bind_from_env
from system.errors import ConfigError
from system.fast_exit import exit_now
from system.launcher import witness
from system.launcher.standby import fork_workers, set_process_name, warm
from system.private_files import set_umask
from system.thread_stacks import dump_stacks_on_signal


def main(argv: list[str] | None = None) -> int:
    # (imported here, after the stacks signal was blocked in __main__: numpy's thread pool
    # starts as it is imported, and a thread started before would take the signal and drop it)
    from workers.kinds import KINDS, worker_class

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trial-dir", required=True)
    p.add_argument("--kind", required=True, choices=sorted(KINDS))
    p.add_argument("--index", type=int, default=None)
    p.add_argument(STANDBY_FLAG, action="store_true",
                   help="a warm spare (scheduler.spares): import, then wait to be activated")
    args = p.parse_args(argv)
    try:
        os.environ.update(task_env(os.environ))  # before CUDA is initialised, here or in vLLM
    except ConfigError as e:
        print(f"{args.kind}: GPU placement: {e}", file=sys.stderr)
        return 2
    bind_from_env()  # a spare: its group's CPUs, before it imports (and starts thread pools)
    # a log is read for why a worker died: not for a progress bar per checkpoint shard (read by
    # transformers and huggingface_hub when imported; a user's own setting wins)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from experiments.catalog import get_experiment

    bootstrap = os.path.join(args.trial_dir, "bootstrap.json")
    prepared = None
    if args.standby:
        set_process_name(f"warm/{args.kind}")  # importing; then "spare/KIND": ready
        # (its stdout carries its answers to the scheduler: scheduler.spares.Forked)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s spare/{args.kind} %(levelname)s %(message)s")
        spare_boot = Bootstrap.read(bootstrap)
        experiment = get_experiment(spare_boot.experiment)
        warm(experiment.warm.get(args.kind), spare_boot)
        set_process_name(f"spare/{args.kind}")
        prep = experiment.prepare.get(args.kind)
        serves_start = os.environ.pop(SERVES_START_ENV, "") == "1"  # (not its workers' own)
        forked = fork_workers(args.kind, None if prep is None else (
            lambda: prep(Bootstrap.read(bootstrap))),  # returns in a forked child, as that worker
            serving_start=serves_start)
        if forked is None:
            return 0
        activation, prepared = forked
        dump_stacks_on_signal()  # (this forked worker's own thread for it)
        args.index = activation.index
        bind_from_env()  # this worker's own CPUs (its activation's environment)
        logging.getLogger().handlers.clear()  # the worker's own log format, on its log file
    index, local_rank = task_identity(args.index)
    if _restarted_elsewhere(args.kind, index):  # (its witness would vouch over the other's)
        return 0
    boot = Bootstrap.read(bootstrap)
    if boot.scheduler == "slurm":
        witness.start(boot, args.kind, index)  # before the worker's own threads start
    set_process_name(f"{args.kind}/{index}")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"%(asctime)s {args.kind}/{index} %(levelname)s %(message)s")
    if os.environ.get(CPUS_ENV):
        logging.getLogger("cpu-binding").info("on CPUs %s", os.environ[CPUS_ENV])
    if args.standby:
        logging.getLogger("standby").info("forked by a warm spare (pid %d): %s/%d",
                                          os.getppid(), args.kind, index)
    set_umask(boot.group_readable)  # whoever started us: checkpoints, metrics stay private
    role = get_experiment(boot.experiment).roles_for(boot.mode).of(args.kind)
    worker = worker_class(args.kind)(boot, index, local_rank)
    worker.prepared = prepared
    if _restarted_elsewhere(args.kind, index):  # (marked while it imported: not registered)
        return 0
    return worker.run(role)


def _restarted_elsewhere(kind: str, index: int) -> bool:
    """Whether this task is a copy of a worker restarted elsewhere while its job ran on,
    started again by that job (:func:`scheduler.slurm_marks.forgotten_here`); said if so. It
    must exit before it registers: that would be over its replacement's name."""
    mark = forgotten_here(index)
    if mark is not None:
        print(f"{kind}/{index} was restarted elsewhere while job "
              f"{os.environ.get('SLURM_JOB_ID', '?')} ran on ({mark}): this copy exits",
              file=sys.stderr)
    return mark is not None


def task_identity(index: int | None) -> tuple[int, int]:
    """``(worker index, local rank)``: given explicitly (local scheduler), or from Slurm: the
    task's global rank plus ``RLSYS_WORKER_BASE``, the index of its job's first worker (a
    recovery's job that restarts worker ``k`` alone runs one task with base ``k``)."""
    if index is not None:
        return index, 0
    if "SLURM_JOB_ID" in os.environ:
        # submitit's generic JobEnvironment() only recognises jobs its own executor submitted
        # (SUBMITIT_EXECUTOR); its Slurm environment class reads the same SLURM_* variables.
        from submitit.slurm.slurm import SlurmJobEnvironment

        env = SlurmJobEnvironment()
        return int(os.environ.get("RLSYS_WORKER_BASE") or 0) + env.global_rank, env.local_rank
    return int(os.environ.get("RLSYS_WORKER_INDEX", 0)), 0


if __name__ == "__main__":
    dump_stacks_on_signal()  # first, before any thread: SIGURG writes every thread's stack
    exit_now(main())  # without the interpreter's tear-down of torch et al. (1 CPU-s)
