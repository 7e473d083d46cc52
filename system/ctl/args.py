"""Which trial a command means: ``exp=E trial=T [cluster.fileroot=DIR]``, parsed and validated
exactly as the launcher does (:func:`~system.launcher.overrides.parse_cli` and the experiment's
config), so the same words reach the same trial directory.

Only the words are read, never the trial's saved ``config.yaml``: the launcher's ``mode=eval``
rebuilds its config on that file, whose task, reward and agent plugins then have to be
installed, while ctl needs only where the trial is (``cluster.fileroot``, ``exp``, ``trial``
and ``mode``, which the command line alone decides)."""
from __future__ import annotations

import os

from experiments.catalog import get_experiment
from system.checks import check_name
from system.errors import ConfigError
from system.launcher.config import ExperimentConfig, RunMode
from system.launcher.eval_mode import run_paths
from system.launcher.eval_mode import trial_paths as trial_paths_of
from system.launcher.overrides import CliArgs, apply_overrides, parse_cli
from system.paths import TrialPaths


CTL_USAGE = ("name the trial as its launch did: exp=NAME trial=T, with the launch's "
             "cluster.fileroot=DIR if it gave one")


def words_config(args: CliArgs) -> ExperimentConfig:
    """The experiment's config with the command line's words, as the launcher builds it before
    it reads anything of the trial (ConfigError for a bad word)."""
    check_name("trial", args.trial)  # before OmegaConf, which would resolve a '${...}' in it
    experiment = get_experiment(args.exp)
    base = experiment.make_config()
    base.exp, base.trial = args.exp, args.trial
    cfg = apply_overrides(base, args.overrides)
    if cfg.mode == RunMode.EVAL:
        experiment.roles_for(cfg.mode.value)  # refuses an experiment with nothing to evaluate
    return cfg


def trial_paths(words: list[str]) -> TrialPaths:
    """The trial directory ``words`` name (ConfigError for a bad word, or no such trial); with
    ``mode=eval``, the directory of the trial's evaluation run (``<trial>/eval/``)."""
    cfg = words_config(parse_cli(words, usage=CTL_USAGE))
    paths = run_paths(cfg)
    trained = trial_paths_of(cfg).root
    if cfg.mode == RunMode.EVAL and os.path.isdir(trained) and not os.path.isdir(paths.root):
        raise ConfigError(f"trial {cfg.exp}/{cfg.trial} has not been evaluated ({paths.root} "
                          "does not exist); evaluate it with: python -m system.launch "
                          f"exp={cfg.exp} trial={cfg.trial} mode=eval")
    if not os.path.isdir(paths.root):
        raise ConfigError(f"no trial {cfg.exp}/{cfg.trial} under cluster.fileroot="
                          f"{os.path.abspath(cfg.cluster.fileroot)} ({paths.root} does not "
                          "exist); list them with: python -m system.ctl ls --fileroot DIR")
    return paths


def split_words(words: list[str]) -> tuple[list[str], list[str]]:
    """``key=value`` words (the trial) apart from the others (``KIND:INDEX``)."""
    return [w for w in words if "=" in w], [w for w in words if "=" not in w]
