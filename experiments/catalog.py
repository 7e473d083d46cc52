"""Every registered experiment: ``exp=NAME`` names one of these."""
from __future__ import annotations

from experiments import rl_experiments, smoke
from experiments.registry import Experiment
from system.errors import ConfigError

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    smoke.SMOKE, rl_experiments.ARITH_TINY, rl_experiments.SMOLLM2_ARITH)}


def all_experiments() -> dict[str, Experiment]:
    return dict(sorted(EXPERIMENTS.items()))


def get_experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment exp={name!r}; valid: {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[name]
