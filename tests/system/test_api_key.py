"""The per-trial API key of the generation servers' HTTP endpoints: written by the launcher's
trial set-up (mode 0600, fresh at every launch), refused when others could read it."""
from __future__ import annotations

import os
import stat

import pytest

from system.api_key import read_api_key, write_api_key
from system.errors import ConfigError
from system.launch import build_config
from system.launcher.trial_dir import prepare_trial


def test_trial_setup_writes_an_owner_only_key(tmp_path):
    cfg = build_config("smoke", "k", [f"cluster.fileroot={tmp_path}"])
    first = prepare_trial(cfg, "smoke", "{}\n")
    first.lock.release()
    paths = first.paths
    mode = os.stat(paths.api_key).st_mode
    assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600
    key = read_api_key(paths.api_key)
    assert len(key) >= 40 and key.isascii() and key.strip() == key
    relaunch = prepare_trial(cfg, "smoke", "{}\n")  # a new launch of the trial: a new key
    relaunch.lock.release()
    again = relaunch.paths
    assert stat.S_IMODE(os.stat(again.api_key).st_mode) == 0o600
    assert read_api_key(again.api_key) != key


def test_a_key_others_can_read_is_refused(tmp_path):
    path = str(tmp_path / "api_key")
    write_api_key(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="0600"):
        read_api_key(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_api_key(str(tmp_path / "missing"))
    os.symlink(path, tmp_path / "link")
    with pytest.raises(ConfigError):  # never followed: a link could point anywhere
        read_api_key(str(tmp_path / "link"))
