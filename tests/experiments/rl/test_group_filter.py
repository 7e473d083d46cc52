"""Dynamic sampling's filter: groups of equal rewards, and the stop when nothing is left."""
from __future__ import annotations

import pytest

from experiments.rl.group_filter import UniformGroups
from system.errors import ConfigError


def group(*rewards: float) -> dict:
    return {"trajs": [{"reward": r} for r in rewards]}


def test_only_groups_of_equal_rewards_are_filtered_and_only_when_on():
    off = UniformGroups(False, 10)
    assert not off.drops(group(1.0, 1.0)) and off.filtered == 0
    on = UniformGroups(True, 10, filtered=5)  # (the count goes on from a checkpoint's)
    assert on.drops(group(0.0, 0.0, 0.0)) and on.drops(group(1.0, 1.0))
    assert not on.drops(group(0.0, 1.0, 0.0)) and not on.drops(group(0.5, 0.5000001))
    assert on.filtered == 7


def test_a_whole_epoch_of_equal_groups_in_a_row_stops_the_trial():
    f = UniformGroups(True, 3)
    assert f.drops(group(1.0, 1.0)) and f.drops(group(0.0, 0.0))
    assert not f.drops(group(0.0, 1.0))  # a group with a signal starts the count again
    assert f.drops(group(1.0, 1.0)) and f.drops(group(1.0, 1.0))
    with pytest.raises(ConfigError) as e:
        f.drops(group(1.0, 1.0))
    assert str(e.value).startswith("rl.dynamic_sampling=true: the last 3 groups (as many as "
                                   "the training set has prompts) all had equal rewards")
    assert "\n" not in str(e.value)


def test_the_rollout_reward_counts_every_arriving_group_filtered_or_not():
    for enabled in (True, False):
        f = UniformGroups(enabled, 10)
        assert f.rollout_reward() is None
        f.drops(group(1.0, 1.0))
        f.drops(group(0.0, 1.0, 0.0, 0.0))
        assert f.rollout_reward() == 3 / 6 and f.rollout_reward() is None
