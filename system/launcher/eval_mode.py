"""``mode=eval``: a run that evaluates the saved checkpoints of an existing trial.

It runs beside the trial's own files, never over them: its config, secret, logs, job scripts,
``status.json`` and ``summary.json`` live in ``<trial>/eval/`` (its :class:`TrialPaths` root),
while the launcher holds the trial's own lock (no training of the trial runs meanwhile, and no
second evaluation). Its base config is the one the trial was trained with (``<trial>/config.yaml``),
with the command line's overrides on top, so the evaluation uses the trial's task, model and
engines unless told otherwise.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from system.errors import ConfigError, first_line
from system.launcher.config import ExperimentConfig, RunMode
from system.paths import TrialPaths

log = logging.getLogger("launch")

MOVED = {("rl", "metrics"): ("metrics",)}
"""Sections a trial's saved config may hold at their old place (old -> new path)."""

EVAL_DIR = "eval"
"""The evaluation's directory inside the trial directory."""


def trial_paths(cfg: ExperimentConfig) -> TrialPaths:
    """The trial's own directory (the one trained, in either mode)."""
    return TrialPaths.of(cfg.cluster.fileroot, cfg.exp, cfg.trial)


def run_paths(cfg: ExperimentConfig) -> TrialPaths:
    """Where this run's files go: the trial directory, or its ``eval/`` with ``mode=eval``."""
    paths = trial_paths(cfg)
    return paths if cfg.mode == RunMode.TRAIN else TrialPaths(os.path.join(paths.root, EVAL_DIR))


def leftover_logs(cfg: ExperimentConfig) -> list[str]:
    """Where the jobs of the trial's runs write their batch logs: its training's and its
    evaluation's (both run under the trial's lock and its name-resolution keys)."""
    root = trial_paths(cfg).root
    return [os.path.join(root, "logs"), os.path.join(root, EVAL_DIR, "logs")]


def checkpoint_steps(checkpoints: str) -> list[int]:
    """Steps of the committed checkpoint directories (``step_<N>``) under ``checkpoints``."""
    if not os.path.isdir(checkpoints):
        return []
    return sorted(int(d[5:]) for d in os.listdir(checkpoints)
                  if d.startswith("step_") and d[5:].isdigit())


def check_evaluable(cfg: ExperimentConfig) -> None:
    """Refuse, in one line, an evaluation of a trial that has no checkpoint (nothing is
    created for it)."""
    paths = trial_paths(cfg)
    if not os.path.isdir(paths.root):
        raise ConfigError(f"mode=eval: trial {cfg.exp}/{cfg.trial} does not exist "
                          f"({paths.root}); train it first (mode=train)")
    if not checkpoint_steps(paths.checkpoints):
        raise ConfigError(f"mode=eval: trial {cfg.exp}/{cfg.trial} has no checkpoint in "
                          f"{paths.checkpoints}; nothing to evaluate")


def trained_base(cfg: ExperimentConfig, defaults: ExperimentConfig,
                 rebuild: Callable[[ExperimentConfig], ExperimentConfig]) -> ExperimentConfig:
    """With ``mode=eval``, ``cfg`` rebuilt on the config the trial was trained with: the saved
    ``config.yaml`` merged over the experiment's ``defaults``, then ``rebuild`` (the command
    line's overrides again). Without a saved config (or in training), ``cfg`` itself."""
    if cfg.mode != RunMode.EVAL:
        return cfg
    saved = trial_paths(cfg).config
    if not os.path.isfile(saved):
        return cfg
    try:
        schema = OmegaConf.structured(defaults)
        loaded = OmegaConf.load(saved)
        if OmegaConf.select(loaded, "recover.overwrite"):  # (a start-over's: of no use here,
            loaded.recover.overwrite = False  # and refused beside recover=auto since)
        dropped = fit_saved(loaded, schema)
        if dropped:
            log.warning("mode=eval: %s ignores settings this version no longer has: %s",
                        saved, ", ".join(dropped))
        base = OmegaConf.to_object(OmegaConf.merge(schema, loaded))
    except (OmegaConfBaseException, ValueError, TypeError, ConfigError) as e:
        raise ConfigError(f"mode=eval: the trial's config {saved} does not load: "
                          f"{first_line(e)}") from None
    assert isinstance(base, ExperimentConfig)
    return rebuild(base)


def fit_saved(saved: Any, schema: Any, path: str = "") -> list[str]:
    """Bring a trial's saved config (``config.yaml`` as loaded) in line with this version's
    ``schema`` in place: sections that moved (:data:`MOVED`) go to their new place, settings
    the schema no longer has are removed; returns the removed keys (dotted)."""
    if not path:
        for old, new in MOVED.items():
            node = OmegaConf.select(saved, ".".join(old))
            if node is not None and OmegaConf.select(saved, ".".join(new)) is None:
                OmegaConf.update(saved, ".".join(new), node, force_add=True)
    dropped: list[str] = []
    if not isinstance(saved, DictConfig) or not isinstance(schema, DictConfig):
        return dropped
    for key in list(saved.keys()):
        name = f"{path}{key}"
        if key not in schema:
            dropped.append(name)
            del saved[key]
        elif _structured(schema, str(key)):
            dropped += fit_saved(saved[key], schema[key], name + ".")
    return dropped


def _structured(schema: DictConfig, key: str) -> bool:
    """Whether ``schema.key`` is a config section (a dataclass), not a free mapping."""
    node = schema._get_node(key)  # (reading the value would resolve interpolations)
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))
