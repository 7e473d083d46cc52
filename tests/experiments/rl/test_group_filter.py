"""Dynamic sampling's filter: groups of equal rewards, the rewards of every group, and the
budget of one step."""
from __future__ import annotations

from experiments.rl.group_filter import UniformGroups, equal_rewards


def group(*rewards: float) -> dict:
    return {"trajs": [{"reward": r} for r in rewards]}


def test_only_groups_of_equal_rewards_are_filtered_and_only_when_on():
    assert equal_rewards(group(0.0, 0.0)) and not equal_rewards(group(0.5, 0.5000001))
    assert not equal_rewards(group())
    assert not UniformGroups(False, 4, 10).drops(group(1.0, 1.0))
    on = UniformGroups(True, 4, 10, filtered=5)  # (the count goes on from a checkpoint's)
    assert on.drops(group(0.0, 0.0, 0.0)) and not on.drops(group(0.0, 1.0, 0.0))
    assert on.filtered == 5  # (drops has no side effect: a group whose lease is gone is not
    on.arrived(group(1.0, 1.0), filtered=True)  # counted; arrived counts a completed one)
    on.arrived(group(0.0, 1.0), filtered=False)
    assert on.filtered == 6 and on.this_step == 1


def test_past_the_budget_a_step_takes_groups_as_they_come(caplog):
    f = UniformGroups(True, 2, 2)  # at most 2 batches of 2 groups filtered a step
    for _ in range(3):
        assert f.drops(group(1.0, 1.0))
        f.arrived(group(1.0, 1.0), filtered=True)
    assert f.drops(group(1.0, 1.0)) and not caplog.records
    f.arrived(group(1.0, 1.0), filtered=True)
    assert "rl.dynamic_sampling: 4 groups of equal rewards filtered while this step's batch " \
           "filled (rl.max_filtered_batches=2 batches of 2)" in caplog.text
    assert not f.drops(group(1.0, 1.0)) and f.filtered == 4  # (spent: taken as they come)
    f.batch_taken()  # the next step filters afresh
    assert f.drops(group(0.0, 0.0))
    unlimited = UniformGroups(True, 2, 0)
    for _ in range(100):
        unlimited.arrived(group(1.0, 1.0), filtered=True)
    assert unlimited.drops(group(1.0, 1.0))


def test_the_rollout_reward_counts_every_arriving_group_filtered_or_not():
    f = UniformGroups(True, 4, 10)
    assert f.rollout_reward() is None
    f.arrived(group(1.0, 1.0), filtered=True)
    f.arrived(group(0.0, 1.0, 0.0, 0.0), filtered=False)
    assert f.rollout_reward() == 3 / 6 and f.rollout_reward() is None
