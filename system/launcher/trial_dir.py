"""Writing the trial directory ``<fileroot>/<exp>/<trial>/``: resolved config, secret, bootstrap
file, and the JSON files the launcher keeps there."""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from system.api_key import write_api_key
from system.bootstrap import Bootstrap
from system.errors import ConfigError
from system.launcher.config import ExperimentConfig, RecoverMode
from system.paths import TrialPaths
from system.structs import plain
from system.wire import new_secret


def write_secret(path: str) -> bytes:
    """Create a fresh 32-byte per-trial secret, readable by the owner only (mode 0600)."""
    secret = new_secret()
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def name_resolve_root(cfg: ExperimentConfig) -> str:
    """Directory of the ``file`` name-resolution backend: ``name_resolve.file_root``, else
    ``<cluster.fileroot>/.name_resolve``."""
    return cfg.name_resolve.file_root or os.path.join(os.path.abspath(cfg.cluster.fileroot),
                                                      ".name_resolve")


def check_existing(cfg: ExperimentConfig, paths: TrialPaths, dry_run: bool = False) -> None:
    """An existing trial with checkpoints continues (``recover=auto|resume``); ``recover=off``
    starts it over only when asked to (``recover.overwrite=true``: its checkpoints go, unless
    this is a dry run)."""
    recover = cfg.recovery()
    if recover is None or recover.type != RecoverMode.OFF or not os.path.isdir(paths.checkpoints):
        return
    if not any(d.startswith("step_") for d in os.listdir(paths.checkpoints)):
        return
    if not recover.overwrite:
        raise ConfigError(f"trial {cfg.exp}/{cfg.trial} has checkpoints ({paths.checkpoints}): "
                          "recover=off would start it over; continue it with recover=auto (the "
                          "default), or start over with recover.overwrite=true")
    if not dry_run:
        shutil.rmtree(paths.checkpoints)


def prepare_trial(cfg: ExperimentConfig, experiment_name: str, resolved_yaml: str,
                  dry_run: bool = False) -> tuple[TrialPaths, bytes]:
    """Create the trial directory: resolved config, fresh secret (0600), bootstrap file
    (:class:`~system.errors.ConfigError` for a trial that must not be overwritten)."""
    paths = TrialPaths.of(cfg.cluster.fileroot, cfg.exp, cfg.trial)
    check_existing(cfg, paths, dry_run)
    os.makedirs(paths.logs, exist_ok=True)
    with open(paths.config, "w") as f:
        f.write(resolved_yaml)
    secret = write_secret(paths.secret)
    write_api_key(paths.api_key)  # before any worker starts: generation servers read it
    Bootstrap(exp=cfg.exp, trial=cfg.trial, experiment=experiment_name, trial_dir=paths.root,
              interface=cfg.cluster.interface, scheduler=cfg.scheduler.type.value,
              name_resolve=plain(cfg.name_resolve), name_resolve_root=name_resolve_root(cfg),
              rpc=plain(cfg.rpc), heartbeat_ttl=cfg.controller.heartbeat_ttl,
              orphan_timeout=cfg.controller.orphan_timeout).write(paths.bootstrap)
    return paths, secret
