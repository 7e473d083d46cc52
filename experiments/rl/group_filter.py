"""Dynamic sampling (DAPO, ``rl.dynamic_sampling``): groups whose rewards are all equal are
filtered out as they arrive. Their GRPO advantages are all 0, so they would only dilute a
step's batch; filtered, they give their admission slots back and other prompts are sampled in
their place, so a step trains on ``batch_size`` groups that each carry a learning signal.

A policy that gets equal rewards on nearly every prompt (all solved, or none solvable) would
then sample for ever, or nearly, to fill a batch: once ``rl.max_filtered_batches`` batches'
worth of groups were filtered while one step's batch filled, the rest of that batch takes
groups as they come, equal rewards or not, with a warning (verl's ``max_num_gen_batches``
stops the run there instead: a run that solved its task would end as failed; 0: no limit).

The training reward of a step (``reward``) is its batch's; with dynamic sampling that leaves the
groups all right or all wrong out. ``rollout_reward`` is every arriving group's, filtered or
not: what the policy scores on the training prompts, comparable with and without it.
"""
from __future__ import annotations

import logging

from workers.schema import GroupMessage

log = logging.getLogger("rl-master")


def equal_rewards(group: GroupMessage) -> bool:
    """Whether every trajectory of ``group`` got the same reward (its GRPO advantages: 0)."""
    rewards = [float(t["reward"]) for t in group["trajs"]]
    return bool(rewards) and max(rewards) == min(rewards)


class UniformGroups:
    """What dynamic sampling filtered, and the rewards of every group that arrived."""

    def __init__(self, enabled: bool, batch_size: int, max_batches: int,
                 filtered: int = 0) -> None:
        self.enabled, self.batch_size, self.max_batches = enabled, batch_size, max_batches
        self.filtered = filtered
        """Groups filtered out over the whole trial (restored from the checkpoint)."""
        self.this_step = 0
        """Groups filtered out since the last batch was taken."""
        self._sum, self._count = 0.0, 0  # rewards since the last rollout_reward()

    def drops(self, group: GroupMessage) -> bool:
        """Whether dynamic sampling filters ``group`` out: it is on, the group's rewards are
        all equal and this step's budget is not spent (no side effect: see :meth:`arrived`)."""
        return self.enabled and not self.spent() and equal_rewards(group)

    def spent(self) -> bool:
        """Whether this step filtered ``max_batches`` batches' worth of groups already."""
        return bool(self.max_batches) and self.this_step >= self.max_batches * self.batch_size

    def arrived(self, group: GroupMessage, filtered: bool) -> None:
        """Count a group that completed its lease, ``filtered`` out or not."""
        rewards = [float(t["reward"]) for t in group["trajs"]]
        self._sum += sum(rewards)
        self._count += len(rewards)
        if not filtered:
            return
        self.filtered += 1
        self.this_step += 1
        if self.spent():
            log.warning("rl.dynamic_sampling: %d groups of equal rewards filtered while this "
                        "step's batch filled (rl.max_filtered_batches=%d batches of %d): the "
                        "rest of it takes groups as they come; nearly every group gets equal "
                        "rewards (the last: %g): the task is nearly solved, or out of the "
                        "model's reach", self.this_step, self.max_batches, self.batch_size,
                        rewards[0])

    def batch_taken(self) -> None:
        """A step took its batch: the next one's filtered groups count afresh."""
        self.this_step = 0

    def rollout_reward(self) -> float | None:
        """The mean reward of every group that arrived since the last call, filtered or not
        (None: none did)."""
        mean = self._sum / self._count if self._count else None
        self._sum, self._count = 0.0, 0
        return mean
