"""The experiment catalog."""
from __future__ import annotations

import pytest

from experiments.catalog import get_experiment
from system.errors import ConfigError


def test_unknown_experiment_lists_valid():
    with pytest.raises(ConfigError, match="smoke"):
        get_experiment("nope")
