"""Writing the trial directory ``<fileroot>/<exp>/<trial>/``: resolved config, secret, bootstrap
file, and the JSON files the launcher keeps there."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from system.bootstrap import Bootstrap
from system.launcher.config import ExperimentConfig
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


def prepare_trial(cfg: ExperimentConfig, experiment_name: str, resolved_yaml: str
                  ) -> tuple[TrialPaths, bytes]:
    """Create the trial directory: resolved config, fresh secret (0600), bootstrap file."""
    paths = TrialPaths.of(cfg.cluster.fileroot, cfg.exp, cfg.trial)
    os.makedirs(paths.logs, exist_ok=True)
    with open(paths.config, "w") as f:
        f.write(resolved_yaml)
    secret = write_secret(paths.secret)
    Bootstrap(exp=cfg.exp, trial=cfg.trial, experiment=experiment_name, trial_dir=paths.root,
              interface=cfg.cluster.interface, scheduler=cfg.scheduler.type.value,
              name_resolve=plain(cfg.name_resolve), name_resolve_root=name_resolve_root(cfg),
              rpc=plain(cfg.rpc), heartbeat_ttl=cfg.controller.heartbeat_ttl,
              orphan_timeout=cfg.controller.orphan_timeout).write(paths.bootstrap)
    return paths, secret
