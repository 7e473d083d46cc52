"""Dynamic sampling (DAPO, ``rl.dynamic_sampling``): groups whose rewards are all equal are
filtered out as they arrive. Their GRPO advantages are all 0, so they would only dilute a
step's batch; filtered, they give their admission slots back and other prompts are sampled in
their place, so a step trains on ``batch_size`` groups that each carry a learning signal.

A training set whose every prompt gets equal rewards (all solved, or none solvable) would then
never fill a batch: after a whole epoch's worth of groups in a row were filtered (as many as
the training set has prompts), the trial stops in one line instead of sampling for ever.

The training reward of a step (``reward``) is its batch's; with dynamic sampling that leaves the
groups all right or all wrong out. ``rollout_reward`` is every arriving group's, filtered or
not: what the policy scores on the training prompts, comparable with and without it.
"""
from __future__ import annotations

from system.errors import ConfigError
from workers.schema import GroupMessage


class UniformGroups:
    """Which arriving groups dynamic sampling filters out, and how many it did."""

    def __init__(self, enabled: bool, prompts: int, filtered: int = 0) -> None:
        self.enabled, self.prompts = enabled, max(1, prompts)
        self.filtered = filtered
        """Groups filtered out over the whole trial (restored from the checkpoint)."""
        self.in_a_row = 0
        self._sum, self._count = 0.0, 0  # rewards since the last rollout_reward()

    def rollout_reward(self) -> float | None:
        """The mean reward of every group that arrived since the last call, filtered or not
        (None: none did)."""
        mean = self._sum / self._count if self._count else None
        self._sum, self._count = 0.0, 0
        return mean

    def drops(self, group: GroupMessage) -> bool:
        """Whether ``group`` (a completed one, out on lease) is filtered out: dynamic sampling
        is on and its rewards are all equal. Raises ConfigError once a whole epoch's worth of
        groups in a row were."""
        rewards = [float(t["reward"]) for t in group["trajs"]]
        self._sum += sum(rewards)
        self._count += len(rewards)
        if not self.enabled:
            return False
        if not rewards or max(rewards) != min(rewards):
            self.in_a_row = 0
            return False
        self.filtered += 1
        self.in_a_row += 1
        if self.in_a_row >= self.prompts:
            raise ConfigError(
                f"rl.dynamic_sampling=true: the last {self.in_a_row} groups (as many as the "
                f"training set has prompts) all had equal rewards within their group (the "
                f"last: {rewards[0]:g}), so no batch can be filled with groups that carry a "
                "learning signal: the task is solved, or out of the model's reach; set "
                "rl.dynamic_sampling=false or use other prompts")
        return True
