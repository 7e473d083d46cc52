"""The experiment registry: ``exp=NAME`` names a function returning the root config."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Mapping

from system.config import ExperimentConfig
from system.errors import ConfigError

# modules that register experiments; imported on first lookup
EXPERIMENT_MODULES = ("experiments.smoke", "experiments.rl")


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A named experiment: its config factory and the role each worker kind plays in it."""

    name: str
    doc: str
    make_config: Callable[[], ExperimentConfig]
    roles: Mapping[str, str]
    """``kind -> "module:function"`` run by that kind's workers after ``start``."""
    section: str | None = None
    """The experiment's own config section, sent to every worker."""


_REGISTRY: dict[str, Experiment] = {}


def register(name: str, roles: Mapping[str, str], section: str | None = None
             ) -> Callable[[Callable[[], ExperimentConfig]], Callable[[], ExperimentConfig]]:
    def deco(fn: Callable[[], ExperimentConfig]) -> Callable[[], ExperimentConfig]:
        if name in _REGISTRY:
            raise ValueError(f"experiment {name!r} registered twice")
        _REGISTRY[name] = Experiment(name, (fn.__doc__ or "").strip(), fn, dict(roles), section)
        return fn
    return deco


def _load() -> None:
    for module in EXPERIMENT_MODULES:
        importlib.import_module(module)


def all_experiments() -> dict[str, Experiment]:
    _load()
    return dict(sorted(_REGISTRY.items()))


def get_experiment(name: str) -> Experiment:
    exps = all_experiments()
    if name not in exps:
        raise ConfigError(f"unknown experiment exp={name!r}; valid: {sorted(exps)}")
    return exps[name]
