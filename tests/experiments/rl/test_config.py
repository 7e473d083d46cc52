"""The RL config's validation."""
from __future__ import annotations

import pytest

from experiments.rl.config import RLConfig
from system.errors import ConfigError


def test_rl_config_errors_name_the_field():
    # a section names its own fields; the override machinery adds where it is mounted
    with pytest.raises(ConfigError, match="^mode='fast'"):
        RLConfig(mode="fast")
    with pytest.raises(ConfigError, match="sync_interval"):
        RLConfig(sync_interval=3, max_head_offpolicyness=1)
    with pytest.raises(ConfigError, match="sync mode"):
        RLConfig(mode="sync", sync_interval=2)
    with pytest.raises(ConfigError, match="group_size"):
        RLConfig(group_size=1)
    assert RLConfig(mode="sync", max_head_offpolicyness=3).eta == 0
