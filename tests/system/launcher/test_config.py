"""The root experiment config's own validation."""
from __future__ import annotations

import pytest

from system.errors import ConfigError
from system.launch import build_config


def test_bad_trial_name():
    with pytest.raises(ConfigError, match="trial"):
        build_config("smoke", "a/b", [])
