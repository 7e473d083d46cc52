"""DAPO's overlong reward shaping (pure, numpy): completions cut at the token budget.

A completion that ran into ``rl.agent.max_new_tokens`` was truncated: its reward judges an
answer that never finished, which teaches the policy noise. DAPO gives two remedies, both off
by default:

- **soft overlong punishment** (``buffer`` > 0): a completion longer than ``max_new_tokens -
  buffer`` loses reward linearly over the last ``buffer`` tokens of the budget, up to
  ``penalty`` at the budget itself (``min(0, (max_new_tokens - buffer - length) / buffer) *
  penalty``, as verl's DAPO reward manager computes it). The shaped reward makes the
  advantages; the ``reward`` metric, ``rollout_reward`` and dynamic sampling's filter read the
  task's reward (verl's ``filter_groups.metric=acc``).
- **overlong filtering** (``filter``): a trajectory that stopped at the budget (``finish`` is
  ``length``) trains no token; its reward still counts in its group's advantages.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from system.errors import ConfigError


@dataclasses.dataclass
class OverlongConfig:
    """Completions cut at rl.agent.max_new_tokens (DAPO)."""

    buffer: int = 0
    """Soft overlong punishment: a completion longer than rl.agent.max_new_tokens - buffer
    loses reward linearly, up to ``penalty`` at the budget (tokens, tool output included;
    0: off; at most rl.agent.max_new_tokens)."""
    penalty: float = 1.0
    """The reward a completion that used the whole budget loses (>= 0)."""
    filter: bool = False
    """Overlong filtering: a trajectory that stopped at the budget (finish=length) trains no
    token (its reward still counts in its group's advantages)."""

    def __post_init__(self) -> None:
        if isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 0:
            raise ConfigError(f"buffer={self.buffer!r} is not valid; valid: an integer >= 0 "
                              "(tokens; 0: off)")
        if not (isinstance(self.penalty, (int, float)) and np.isfinite(self.penalty)
                and self.penalty >= 0):
            raise ConfigError(f"penalty={self.penalty!r} is not valid; valid: a number >= 0")
        if self.penalty != 1.0 and not self.buffer:
            raise ConfigError(f"penalty={self.penalty} is read only with rl.overlong.buffer > 0 "
                              "(the soft punishment's ramp); valid: set rl.overlong.buffer")

    def check_budget(self, max_new_tokens: int, agent_kind: str) -> None:
        """The shaping measures completions against the agents' own budget: it must hold the
        buffer, and an agent function (``openai``) asks for its own."""
        if not (self.buffer or self.filter):
            return
        if agent_kind == "openai":
            raise ConfigError("rl.overlong needs an agent whose completions rl.agent."
                              "max_new_tokens bounds (kind single or calculator); an agent "
                              "function (kind=openai) asks for its own max_tokens")
        if self.buffer > max_new_tokens:
            raise ConfigError(f"rl.overlong.buffer={self.buffer} is longer than the budget "
                              f"rl.agent.max_new_tokens={max_new_tokens}; valid: 0 to "
                              f"{max_new_tokens}")


def overlong_penalty(lengths: np.ndarray, budget: int, buffer: int, penalty: float
                     ) -> np.ndarray:
    """The (non-positive) reward each completion of ``lengths`` tokens gets added under a
    budget of ``budget`` tokens (zeros when ``buffer`` is 0)."""
    lengths = np.asarray(lengths, np.float64)
    if buffer <= 0:
        return np.zeros(len(lengths), np.float64)
    exceed = lengths - (budget - buffer)
    return np.minimum(-exceed / buffer * penalty, 0.0)
