"""Start a trial.

    python -m system.launch exp=smoke trial=t1                      # run it
    python -m system.launch exp=smoke trial=t1 rollout.count=8     # with overrides
    python -m system.launch exp=smoke trial=t1 --dry-run           # show what would run
    python -m system.launch exp=smoke trial=t1 scheduler=slurm --test-only   # sbatch --test-only
    python -m system.launch exp=smoke trial=t1 scheduler=slurm --detach      # controller as a job
    python -m system.launch --help                                 # experiments and keys

Parses the overrides into the experiment's validated config, writes the trial directory
(``<cluster.fileroot>/<exp>/<trial>/``) and runs the controller. Exit code 0 only when the
master reports completion.
"""
from __future__ import annotations

from system.cli_entry import main_begins, quiet_while_importing, std_fds_open
from system.thread_stacks import dump_stacks_on_signal

if __name__ == "__main__":  # before the imports below start threads (numpy's BLAS pool), so
    dump_stacks_on_signal()  # that they inherit SIGURG blocked: `python -m system.ctl stacks`
    std_fds_open()  # (2>&-: see system.cli_entry)
    quiet_while_importing()  # (a Ctrl-C meanwhile: one line, no traceback)

import dataclasses
import errno
import logging
import os
import shlex
import signal
import sys
import termios
from typing import Any, Callable

from omegaconf import OmegaConf

from experiments.catalog import get_experiment
from experiments.registry import Experiment
from scheduler.base import Scheduler
from scheduler.registry import make_scheduler
from scheduler.slurm import SlurmScheduler
from system.checks import check_name
from system.ctl.output import say, silence
from system.launcher.config import ExperimentConfig, RecoverMode, RunMode
from system.launcher.eval_mode import run_paths, trained_base, trial_paths
from system.launcher.config_changes import describe as describe_changes
from system.launcher.controller import Controller
from system.launcher.launcher_log import tee_stderr
from system.launcher.name_claim import name_taken
from system.errors import ConfigError, RLSystemError
from system.name_resolve import make_name_resolve
from system.name_resolve_config import NameResolveBackend, redis_password
from system.launcher.help import help_text
from system.launcher.overrides import CliArgs, apply_overrides, parse_cli
from system.launcher.own_preemption import PreemptionWatch
from system.launcher.self_requeue import (REQUEUE_WAIT, ControllerRequeue,
                                          cancelled_while_requeued, end_records, own_job,
                                          requeue, requeue_job, restart_count, restart_overrides,
                                          stale_pending, wait_for_requeue)
from system.launcher.groups import group_specs
from system.launcher.submit import (controller_request, detach, dry_run, queued_controller,
                                    refusal)
from system.launcher.trial_dir import PreparedTrial, name_resolve_root, prepare_trial
from system.paths import TrialPaths
from system.private_files import set_umask


def build_config(exp: str, trial: str, overrides: list[str]) -> ExperimentConfig:
    """The experiment's config with ``overrides``; with ``mode=eval``, on the config the trial
    was trained with (:func:`~system.launcher.eval_mode.trained_base`)."""
    check_name("trial", trial)  # before OmegaConf, which would resolve a '${...}' in it
    experiment = get_experiment(exp)

    def build(base: ExperimentConfig) -> ExperimentConfig:
        base.exp, base.trial = exp, trial
        return apply_overrides(base, overrides)

    cfg = build(experiment.make_config())
    if cfg.mode == RunMode.EVAL:
        experiment.roles_for(cfg.mode.value)  # refuses an experiment with nothing to evaluate
    cfg = trained_base(cfg, experiment.make_config(), build)
    absolute_paths(cfg)
    return cfg


LAUNCHER_RELATIVE_PATHS = ("rl.model_path", "rl.task.train_path", "rl.task.eval_path",
                           "name_resolve.file_root")
"""Path-valued keys a user sets and workers read: a relative one is taken from the directory
the launcher runs in, and made absolute when the config is built (so ``config.yaml`` holds the
absolute path and every worker reads the same file whatever directory its scheduler starts it
in; local workers inherit the launcher's, Slurm jobs start in ``scheduler.slurm.workdir``). A
key an experiment lacks is skipped. Not listed: ``cluster.fileroot`` (read by the launcher
only, made absolute where used; workers get the absolute trial directory),
``scheduler.slurm.workdir`` (made absolute by the scheduler), ``name_resolve.
redis_password_file`` (made absolute by its section), and the paths a job script resolves on
the compute node (``scheduler.slurm.python``, the container and Apptainer images and mounts)."""


def absolute_paths(cfg: ExperimentConfig, cwd: str | None = None) -> dict[str, str]:
    """Make each non-empty relative :data:`LAUNCHER_RELATIVE_PATHS` key of ``cfg`` absolute
    against ``cwd`` (default: this process's working directory; ``~`` is expanded); return
    every such key with its (absolute) value."""
    cwd = os.getcwd() if cwd is None else cwd
    out = {}
    for key in LAUNCHER_RELATIVE_PATHS:
        *sections, name = key.split(".")
        node: Any = cfg
        for part in sections:
            node = getattr(node, part, None)
        value = getattr(node, name, None) if node is not None else None
        if not isinstance(value, str) or not value:
            continue
        value = os.path.normpath(os.path.join(cwd, os.path.expanduser(value)))
        setattr(node, name, value)
        out[key] = value
    return out


def absolute_argv(argv: list[str], cfg: ExperimentConfig) -> list[str]:
    """``argv`` for a launcher that starts elsewhere (``--detach``: the controller job starts
    in ``scheduler.slurm.workdir``): each :data:`LAUNCHER_RELATIVE_PATHS` key ``cfg`` sets, and
    ``cluster.fileroot`` (the trial directory this launcher prepared), is given with its
    absolute value (``cfg``'s paths are absolute already)."""
    paths = {**absolute_paths(cfg), "cluster.fileroot": os.path.abspath(cfg.cluster.fileroot)}
    return [*(a for a in argv if a.partition("=")[0] not in paths),
            *(f"{k}={v}" for k, v in paths.items())]


EXTRA_FLAGS = ("--detach", "--test-only")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)


class StopOnSignal:
    """SIGTERM (scancel of a detached controller, a shutdown), SIGHUP (the terminal closed) and
    SIGUSR2 (Slurm's warning before a detached controller's time limit) stop a trial like
    Ctrl-C: the first raises ``KeyboardInterrupt`` in the controller, which stops every worker
    and cancels every job; SIGUSR2 to a controller that requeues its own job (``requeue_job``,
    see :mod:`system.launcher.self_requeue`) raises :class:`ControllerRequeue`. Later ones are
    ignored, and so is any that comes while the controller cleans up (it ignores SIGINT
    meanwhile): a signal must not cut that cleanup short and leave workers or jobs behind."""

    def __init__(self, requeue_job: str | None = None,
                 warning: Callable[[], float | None] = lambda: None) -> None:
        self.first: str | None = None
        self.handled: list[signal.Signals] = []
        self._raised: BaseException | None = None  # (see redeliver)
        self.requeue_job = requeue_job
        self.warning = warning
        """Seconds before Slurm ends the requeuing controller's job (None: unknown)."""

    def install(self) -> None:
        """Handle each stop signal, except one this process was started ignoring (``nohup``
        ignores SIGHUP, a background job of a script SIGINT): that choice is the caller's."""
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self)
                self.handled.append(sig)

    def ignore(self) -> None:
        """From now on (the trial has ended) the stop signals are ignored by the kernel: the
        interpreter's exit sets a signal it handles back to its default, and one that came then
        (a hang-up just after a Ctrl-C's clean stop) ended the launcher as killed by it."""
        for sig in self.handled:
            signal.signal(sig, signal.SIG_IGN)

    def _cleaning_up(self) -> bool:
        """The controller ignores SIGINT while it stops everything."""
        return (signal.SIGINT in self.handled
                and signal.getsignal(signal.SIGINT) is signal.SIG_IGN)

    def __call__(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            _leave_terminal()
        if self.first is not None or self._cleaning_up():
            logging.getLogger("launch").warning("%s while stopping: ignored", name)
            return
        self.first = name
        if signum == signal.SIGUSR2 and self.requeue_job is not None:
            self._raised = ControllerRequeue(self.requeue_job, self.warning)
        else:
            self._raised = KeyboardInterrupt(name)
        raise self._raised

    def redeliver(self) -> None:
        """Raise again the stop the handler raised, if it has not stopped the trial: raised
        where an exception cannot propagate (the logging module's at-fork hook, while the
        local scheduler starts a worker, prints it as "ignored"), it was lost and the trial
        ran on to its end. Called with every poll of the jobs, before the stop is handled."""
        raised, self._raised = self._raised, None
        if raised is not None and not self._cleaning_up():  # (handled: the cleanup is on)
            raise raised


def _leave_terminal() -> None:
    """After a hang-up, writes to the terminal fail (EIO) and would break the cleanup that
    follows: send stdout and stderr of a terminal to /dev/null (summary.json keeps the outcome)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if _terminal(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


def _terminal(fd: int) -> bool:
    """``fd`` is a terminal, live or hung up (``isatty`` says False once it has hung up)."""
    try:
        termios.tcgetattr(fd)
        return True
    except termios.error as e:
        return e.args[0] == errno.EIO


def main(argv: list[str] | None = None) -> int:
    main_begins()
    argv = sys.argv[1:] if argv is None else argv
    restarted: list[str] = []  # a requeued controller's trial directory, once known
    try:
        code = launch(argv, restarted)
    except KeyboardInterrupt:  # before the controller runs (it handles its own): no traceback
        print("interrupted before the trial's controller started", file=sys.stderr)
        return 130
    if restarted and stale_pending(TrialPaths(restarted[0])):  # its controller never wrote
        end_records(TrialPaths(restarted[0]), "completed" if code == 0 else "failed",
                    f"the controller's job started again and ended (exit code {code}) before "
                    "its controller ran: see logs/controller.log")
    return code


def launch(argv: list[str], restarted: list[str]) -> int:
    """:func:`main`'s launch; appends the trial's directory to ``restarted`` when this is its
    detached controller's job started again after a requeue."""
    try:
        args = parse_cli(argv, EXTRA_FLAGS)
        if args.help:
            say(help_text(args.exp))  # (to a reader that may go: ``--help | head``)
            return 0
        job = own_job(args.exp, args.trial) if restart_count() else None
        requeued = job is not None
        if requeued:  # this trial's controller job, started again: continue the trial
            args = dataclasses.replace(args, overrides=restart_overrides(args.overrides))
            print(f"the controller's job {job} started again (restart {restart_count()}): the "
                  "trial continues from its checkpoint", file=sys.stderr)
        cfg = build_config(args.exp, args.trial, args.overrides)
        if requeued:
            restarted.append(trial_paths(cfg).root)
            if cancelled_while_requeued(trial_paths(cfg)):
                end_records(trial_paths(cfg), "cancelled", "cancelled (python -m system.ctl "
                            "cancel) while the controller's job was requeued: not continued")
                print("cancelled while requeued: the trial is not continued", file=sys.stderr)
                return 1
        if args.flags and cfg.scheduler.type.value != "slurm":
            raise ConfigError(f"{' and '.join(args.flags)} need"
                              f"{'s' if len(args.flags) == 1 else ''} scheduler=slurm")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    umask = private_modes(cfg.cluster.group_readable)
    experiment = get_experiment(args.exp)
    try:
        done = None if args.dry_run or "--test-only" in args.flags else \
            done_already(cfg, experiment)
    except ConfigError as e:  # e.g. nothing to evaluate on
        print(f"error: {e}", file=sys.stderr)
        return 2
    if done is not None:  # trained or evaluated to the end already: write and start nothing
        print(done, file=sys.stderr)
        return 0
    resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    try:  # before the trial's directory is touched: a refused launch changes none of its files
        scheduler = machine_scheduler(cfg, umask)
    except RLSystemError as e:  # (exit code 1: this machine, not the config, is the limit)
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        check_jobs(cfg, scheduler, args, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    queued = (queued_controller(cfg, run_paths(cfg), scheduler.scancel_timeout)
              if "--detach" in args.flags and isinstance(scheduler, SlurmScheduler) else None)
    if queued is not None:  # an earlier --detach's controller, not started yet: it holds no lock
        print(f"error: {refusal(cfg, queued)}", file=sys.stderr)
        return 1
    try:  # another directory's trial of this name, live on the same name service
        taken = None if args.dry_run or "--test-only" in args.flags else name_taken(cfg)
    except RLSystemError as e:  # (the name service does not answer, say)
        taken = str(e)
    if taken is not None:
        print(f"error: {taken}", file=sys.stderr)
        return 1
    try:
        continues = (cfg.mode == RunMode.TRAIN and cfg.recovery() is not None
                     and cfg.recovery().type != RecoverMode.OFF)
        check = experiment.resume_check
        trial = prepare_trial(cfg, experiment.name, resolved,
                              dry_run=args.dry_run or "--test-only" in args.flags,
                              before_write=(lambda: check(cfg, trial_paths(cfg).root))
                              if continues and check is not None else None,
                              requeuing_controller=requeue_job(cfg) is not None)
    except ConfigError as e:  # e.g. recover=off on a trial that has checkpoints
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RLSystemError, OSError) as e:  # running already, not the user's, not writable
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:  # the lock is held until the controller is done (with --detach: until submitted)
        return run_trial(cfg, experiment, trial, scheduler, args, argv, resolved)
    finally:
        trial.lock.release()


def machine_scheduler(cfg: ExperimentConfig, umask: int) -> Scheduler:
    """The trial's scheduler, once the config's checks against this machine pass (the
    experiment's own, :meth:`~ExperimentConfig.check_machine`; CPU and GPU placement; a Redis
    password file). Writes nothing: run before the trial's directory is touched, so a launch
    refused here leaves the last run's files (``summary.json``, ``status.json``,
    ``config.yaml``, ``secret``) as they were."""
    cfg.check_machine()
    if cfg.name_resolve.type == NameResolveBackend.REDIS:
        redis_password(cfg.name_resolve)  # (missing, empty, or not private)
    return make_scheduler(cfg.scheduler, cfg.exp, cfg.trial, run_paths(cfg).root, umask,
                          cfg.gpu_demands(), cfg.worker_counts())


def check_jobs(cfg: ExperimentConfig, scheduler: Scheduler, args: CliArgs,
               argv: list[str]) -> None:
    """Plan every job the launch would submit or start (pure: nothing is written), so a
    config the scheduler cannot turn into jobs (``scheduler.slurm.model.nodes=3`` for 2 model
    workers, a log path Slurm cannot write...) is a :class:`ConfigError` before the trial's
    directory is touched: each group's own job (the pre-flight's), the jobs as submitted
    (``hetjob``: one for all), and with ``--detach`` the controller's."""
    paths = run_paths(cfg)
    groups = [g for g in group_specs(cfg, paths, scheduler.python).values() if g.count]
    for group in groups:
        scheduler.plan(group)
    scheduler.plan_all(groups)
    if "--detach" in args.flags and isinstance(scheduler, SlurmScheduler):
        controller_request(cfg, paths, scheduler,
                           absolute_argv([a for a in argv if a != "--detach"], cfg))


def private_modes(group_readable: bool) -> int:
    """From here on every file of the trial is private (0600/0700; 0640/0750 group-readable),
    in this process, its children, and the Slurm jobs it submits (``sbatch`` passes
    ``SLURM_UMASK`` on, taking it from the environment before its own umask)."""
    umask = set_umask(group_readable)
    os.environ["SLURM_UMASK"] = f"{umask:04o}"
    return umask


def done_already(cfg: ExperimentConfig, experiment: Experiment) -> str | None:
    """The experiment's line saying there is nothing left to do: with ``mode=eval``, to
    evaluate; for a training run that continues its trial, to train. None to run (also when
    the trial's files do not read: the run itself then says why). Asked before the trial's
    lock and files: such a run writes nothing, ``--detach`` included."""
    recover = cfg.recovery()
    if cfg.mode == RunMode.EVAL and experiment.eval_done is not None:
        what, done = "evaluated", lambda: experiment.eval_done(  # type: ignore[misc]
            cfg, trial_paths(cfg).root, run_paths(cfg).root)
    elif (cfg.mode == RunMode.TRAIN and experiment.train_done is not None
          and recover is not None and recover.type != RecoverMode.OFF):
        what, done = "trained", lambda: experiment.train_done(  # type: ignore[misc]
            cfg, trial_paths(cfg).root)
    else:
        return None
    try:
        return done()
    except (OSError, ValueError, AttributeError, TypeError) as e:  # (a malformed file)
        logging.getLogger("launch").warning("could not tell what is %s already (%s); "
                                            "running", what, e)
        return None


def run_trial(cfg: ExperimentConfig, experiment: Experiment, trial: PreparedTrial,
              scheduler: Scheduler, args: CliArgs, argv: list[str], resolved: str) -> int:
    """Show, submit, or run the trial's controller (the launcher holds the trial's lock;
    ``scheduler`` passed :func:`machine_scheduler` and :func:`check_jobs`)."""
    paths = trial.paths
    shown = args.dry_run or "--test-only" in args.flags
    try:
        if not shown and "--detach" not in args.flags:
            # logs/launcher.log, for `python -m system.ctl logs` (and `stacks`)
            tee_stderr(paths.logs, "python -m system.launch " + shlex.join(argv))
        if trial.changes:
            print(describe_changes(f"{cfg.exp}/{cfg.trial}", trial.changes), file=sys.stderr)
        if shown:
            try:
                code = dry_run(cfg, paths, scheduler, resolved, "--test-only" in args.flags)
                sys.stdout.flush()  # (what is buffered: its reader may be gone)
                return code
            except BrokenPipeError:  # ``--dry-run | head``: the rest is not wanted, but its
                silence(sys.stdout)  # checks (--test-only's sbatch, the pre-flight) still say
                return dry_run(cfg, paths, scheduler, resolved, "--test-only" in args.flags)
        if "--detach" in args.flags:
            return detach(cfg, paths, scheduler,
                          absolute_argv([a for a in argv if a != "--detach"], cfg), trial.lock)
        controller = Controller(cfg, experiment, paths, scheduler,
                                make_name_resolve(cfg.name_resolve, name_resolve_root(cfg),
                                                  trial.secret),
                                cfg.rpc.codec(trial.secret))
    except RLSystemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    job = requeue_job(cfg)
    watch = None if job is None else PreemptionWatch(job)
    stop = StopOnSignal(job, watch.seconds_left if watch else lambda: None)
    stop.install()
    controller.status.before_tick = stop.redeliver
    if watch is not None:
        watch.start()
    try:
        code = controller.run()
    finally:
        stop.first = stop.first or "the end"  # (a signal after run() is ignored, as within)
        stop.ignore()
        if watch is not None:
            watch.close()
    if job is None or controller.outcome != "requeued":
        return code
    if cancelled_while_requeued(paths):  # (ctl cancel while it stopped the trial)
        end_records(paths, "cancelled", "cancelled (python -m system.ctl cancel): not requeued")
        print(f"cancelled: job {job} is not requeued", file=sys.stderr)
        return 1
    trial.lock.release()  # (before Slurm ends this process: the next start takes it)
    error = requeue(job)
    if error is None:
        wait_for_requeue(job)
        error = f"Slurm did not end job {job} within {REQUEUE_WAIT:.0f}s of the request"
    print(f"error: the controller's job {job} was not requeued: {error}; continue the "
          f"trial by launching it again", file=sys.stderr)
    end_records(paths, "interrupted", f"not requeued: {error}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
