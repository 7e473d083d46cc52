"""Writing the trial directory ``<fileroot>/<exp>/<trial>/``: resolved config, secret, bootstrap
file, and the JSON files the launcher keeps there.

The directory is the user's own (a pre-existing one of another user is refused) with mode 0700
(0750 with ``cluster.group_readable=true``); the launcher locks it (:mod:`trial_lock`) before it
writes anything, so a second launch cannot replace the secret of a running trial.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import stat
import time
from typing import Any, Callable

from system.api_key import write_api_key
from system.bootstrap import Bootstrap
from system import json_text
from system.errors import ConfigError
from system.launcher.config import ExperimentConfig, RecoverMode, RunMode
from system.launcher.config_changes import changed_settings
from system.launcher.eval_mode import (EVAL_DIR, check_evaluable, checkpoint_steps, run_paths,
                                       trial_paths)
from system.launcher.trial_lock import TrialLock
from system.paths import TrialPaths
from system.private_files import dir_mode, ensure_owned_dir, file_mode, write_private
from system.structs import plain
from system.wire import new_secret


@dataclasses.dataclass
class PreparedTrial:
    """A written trial directory, its fresh secret, and its lock (held until released or the
    process ends)."""

    paths: TrialPaths
    secret: bytes
    lock: TrialLock
    changes: list[str] = dataclasses.field(default_factory=list)
    """A continued trial's settings that differ from its last launch's
    (:func:`~system.launcher.config_changes.changed_settings`)."""


def write_secret(path: str) -> bytes:
    """Create a fresh 32-byte per-trial secret, readable by the owner only (mode 0600), in place
    of the old one at once (a fresh file renamed over it)."""
    secret = new_secret()
    write_private(path, secret, 0o600)
    return secret


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically, as private as the trial's other files
    whatever this process's umask (``system.ctl`` sets none): 0640 in a group-readable
    directory, else 0600."""
    group = os.stat(os.path.dirname(path) or ".").st_mode & stat.S_IRGRP
    write_private(path, json_text.dumps(obj, indent=2, default=str).encode(),
                  0o640 if group else 0o600)


def now_iso(t: float | None = None) -> str:
    """Local time ``t`` (epoch seconds; default now) as the trial's records write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def name_resolve_root(cfg: ExperimentConfig) -> str:
    """Directory of the ``file`` name-resolution backend: ``name_resolve.file_root``, else
    ``<cluster.fileroot>/.name_resolve``."""
    return cfg.name_resolve.file_root or os.path.join(os.path.abspath(cfg.cluster.fileroot),
                                                      ".name_resolve")


def check_existing(cfg: ExperimentConfig, paths: TrialPaths, dry_run: bool = False) -> None:
    """An existing trial with checkpoints continues (``recover=auto|resume``); ``recover=off``
    starts it over only when asked to (``recover.overwrite=true``: its checkpoints and their
    evaluations go, unless this is a dry run). An evaluation (``mode=eval``) leaves the trial
    as it is."""
    recover = cfg.recovery()
    if cfg.mode == RunMode.EVAL:
        return
    if recover is None or recover.type != RecoverMode.OFF or not os.path.isdir(paths.checkpoints):
        return
    if not checkpoint_steps(paths.checkpoints):  # (a staged one, never committed, is none)
        return
    if not recover.overwrite:
        raise ConfigError(f"trial {cfg.exp}/{cfg.trial} has checkpoints ({paths.checkpoints}): "
                          "recover=off would start it over; continue it with recover=auto (the "
                          "default), or start over with recover.overwrite=true")
    if not dry_run:  # (and the evaluations of those checkpoints: results of another run)
        shutil.rmtree(paths.checkpoints)
        shutil.rmtree(os.path.join(paths.root, EVAL_DIR), ignore_errors=True)


CANNOT_CREATE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR,
                 errno.EISDIR, errno.ENOSPC, errno.EDQUOT)
"""Why a trial directory cannot be made that ``cluster.fileroot`` is the one to change."""


def make_trial_dir(cfg: ExperimentConfig, paths: TrialPaths) -> None:
    """Create the trial directory with its mode (parents under the umask; existing ones keep
    theirs); refuse one that is a link or another user's
    (:class:`~system.errors.UnsafeFileError`)."""
    try:
        ensure_owned_dir(paths.root, dir_mode(cfg.cluster.group_readable), "the trial directory",
                         adjust=False)  # its mode is set once the lock is held
    except OSError as e:  # (an unsafe directory, UnsafeFileError, is no OSError)
        if e.errno not in CANNOT_CREATE:
            raise
        raise ConfigError(f"cluster.fileroot={cfg.cluster.fileroot}: cannot create the trial "
                          f"directory {paths.root} ({e.strerror})") from None


def forget_outcome(paths: TrialPaths) -> None:
    """Remove a previous run's ``summary.json`` and ``status.json``: they describe that run, and
    a launch that stops before writing its own (SIGKILL, a lost node, a name service that does
    not answer) must not leave them looking like this run's outcome (the controller writes
    ``status.json`` as soon as it starts)."""
    for path in (paths.summary, paths.status):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def prepare_trial(cfg: ExperimentConfig, experiment_name: str, resolved_yaml: str,
                  dry_run: bool = False,
                  before_write: Callable[[], None] | None = None,
                  requeuing_controller: bool = False) -> PreparedTrial:
    """Create and lock the trial directory, then write the resolved config, a fresh secret
    (0600) and the bootstrap file (:class:`~system.errors.ConfigError` for a trial that must not
    be overwritten, :class:`~system.errors.TrialLocked` for one that is running). With
    ``mode=eval`` these go to ``<trial>/eval/`` and the trial's own lock is held: the trial must
    exist and have a checkpoint (:func:`~system.launcher.eval_mode.check_evaluable`). A dry run
    of an existing trial writes none of them (its secret is then empty). ``before_write``
    (the experiment's check that an existing trial can be continued) runs once the lock is
    held, before anything is written. A previous run's ``summary.json`` and ``status.json``
    are removed (:func:`forget_outcome`), but by a dry run. ``requeuing_controller``: this is
    the trial's detached controller, which requeues its own job at its warning (the master
    fits its checkpoint to that controller's wait too: :attr:`Bootstrap.controller_stop_grace`)."""
    paths = run_paths(cfg)
    if cfg.mode == RunMode.EVAL:
        check_evaluable(cfg)
    make_trial_dir(cfg, paths)
    lock = TrialLock.acquire(trial_paths(cfg).lock, f"{cfg.exp}/{cfg.trial}", cfg.mode.value)
    try:  # a second launch is refused above before it changes anything
        os.chmod(paths.root, dir_mode(cfg.cluster.group_readable))
        check_existing(cfg, paths, dry_run)
        if before_write is not None:
            before_write()
        os.makedirs(paths.logs, exist_ok=True)
        changes = continued_changes(cfg, paths, resolved_yaml)
        if dry_run and os.path.isfile(paths.config):
            # a dry run shows what would run; an existing trial keeps its own config (which an
            # evaluation and the next launch read), secret, API key and bootstrap file
            return PreparedTrial(paths, b"", lock, changes)
        mode = file_mode(cfg.cluster.group_readable)
        if not dry_run:
            forget_outcome(paths)
        write_private(paths.config, resolved_yaml.encode(), mode)
        secret = write_secret(paths.secret)
        write_api_key(paths.api_key)  # before any worker starts: generation servers read it
        Bootstrap(exp=cfg.exp, trial=cfg.trial, experiment=experiment_name, trial_dir=paths.root,
                  interface=cfg.cluster.interface, scheduler=cfg.scheduler.type.value,
                  name_resolve=plain(cfg.name_resolve), name_resolve_root=name_resolve_root(cfg),
                  rpc=plain(cfg.rpc), heartbeat_ttl=cfg.controller.heartbeat_ttl,
                  orphan_timeout=cfg.controller.orphan_timeout,
                  group_readable=cfg.cluster.group_readable, mode=cfg.mode.value,
                  evaluated_dir=(trial_paths(cfg).root if cfg.mode == RunMode.EVAL else ""),
                  preempt_warning=(float(cfg.scheduler.slurm.signal_seconds)
                                   if cfg.scheduler.type.value == "slurm" else 0.0),
                  controller_stop_grace=(cfg.scheduler.stop_grace if requeuing_controller
                                         else None)
                  ).write(paths.bootstrap)
    except BaseException:
        lock.release()
        raise
    return PreparedTrial(paths, secret, lock, changes)


def continued_changes(cfg: ExperimentConfig, paths: TrialPaths, resolved_yaml: str) -> list[str]:
    """The settings a training run that continues its trial's checkpoints changes from the
    last launch's ``config.yaml`` (none for a new trial, one started over, an evaluation)."""
    recover = cfg.recovery()
    if recover is None or recover.type == RecoverMode.OFF or not os.path.isdir(paths.checkpoints):
        return []
    if not checkpoint_steps(paths.checkpoints):
        return []
    try:
        with open(paths.config, encoding="utf-8") as f:
            return changed_settings(f.read(), resolved_yaml)
    except (OSError, ValueError):  # (no config.yaml yet; not text)
        return []
