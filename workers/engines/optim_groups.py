"""An optimizer restored from a checkpoint keeps its state (moments, step counts) but takes its
hyper-parameters from the configuration of the run that continues it: a changed
``rl.actor.lr`` (or betas, eps, weight decay) applies from the first resumed step, as users
expect, instead of being silently overwritten by the checkpoint's param groups."""
from __future__ import annotations

import logging
from typing import Any, Iterable

log = logging.getLogger("optimizer")

CONFIGURED = ("lr", "betas", "eps", "weight_decay")
"""Param-group entries that come from the configuration, never from a checkpoint."""


def configured(groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The configured entries of each param group (before a checkpoint is loaded)."""
    return [{k: g[k] for k in CONFIGURED if k in g} for g in groups]


def reapply(groups: Iterable[dict[str, Any]], before: list[dict[str, Any]]) -> list[str]:
    """Put the configured entries ``before`` back into ``groups`` (after a checkpoint was
    loaded); returns ``"lr 0.0005 -> 0.05"`` for each entry the checkpoint had otherwise."""
    changed = []
    for group, mine in zip(groups, before):
        for k, v in mine.items():
            old = group.get(k)
            if k in group and old != v:
                text = f"{k} {old} -> {v}"
                if text not in changed:
                    changed.append(text)
            group[k] = v
    if changed:
        log.info("optimizer restored from the checkpoint with this run's settings: %s",
                 ", ".join(changed))
    return changed
