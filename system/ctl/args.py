"""Which trial a command means: ``exp=E trial=T [cluster.fileroot=DIR]``, parsed and validated
exactly as the launcher does (:func:`~system.launcher.overrides.parse_cli` and the experiment's
config), so the same words reach the same trial directory."""
from __future__ import annotations

import os

from system.errors import ConfigError
from system.launch import build_config
from system.launcher.eval_mode import run_paths
from system.launcher.overrides import parse_cli
from system.paths import TrialPaths


def trial_paths(words: list[str]) -> TrialPaths:
    """The trial directory ``words`` name (ConfigError for a bad word, or no such trial); with
    ``mode=eval``, the directory of the trial's evaluation run (``<trial>/eval/``)."""
    args = parse_cli(words)
    cfg = build_config(args.exp, args.trial, args.overrides)
    paths = run_paths(cfg)
    if not os.path.isdir(paths.root):
        raise ConfigError(f"no trial {cfg.exp}/{cfg.trial} under cluster.fileroot="
                          f"{os.path.abspath(cfg.cluster.fileroot)} ({paths.root} does not "
                          "exist); list them with: python -m system.ctl ls --fileroot DIR")
    return paths


def split_words(words: list[str]) -> tuple[list[str], list[str]]:
    """``key=value`` words (the trial) apart from the others (``KIND:INDEX``)."""
    return [w for w in words if "=" in w], [w for w in words if "=" not in w]
