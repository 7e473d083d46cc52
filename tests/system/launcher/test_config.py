"""The root experiment config's own validation."""
from __future__ import annotations

import pytest

from system.errors import ConfigError
from system.launch import build_config


def test_bad_trial_name():
    with pytest.raises(ConfigError, match="trial"):
        build_config("smoke", "a/b", [])


def test_recover_off_refuses_a_trial_with_checkpoints_unless_asked(tmp_path):
    import os

    from system.errors import ConfigError
    from system.launch import build_config
    from system.launcher.trial_dir import check_existing
    from system.paths import TrialPaths

    def cfg(*overrides: str):
        return build_config("arith-tiny", "t", [f"cluster.fileroot={tmp_path}", *overrides])

    paths = TrialPaths.of(str(tmp_path), "arith-tiny", "t")
    check_existing(cfg("recover=off"), paths)  # a new trial: nothing to protect
    os.makedirs(os.path.join(paths.checkpoints, "step_4.tmp"))  # a first save, never committed
    with open(os.path.join(paths.checkpoints, "latest"), "w") as f:
        f.write("4")
    check_existing(cfg("recover=off"), paths)  # (it said "has checkpoints")
    os.makedirs(os.path.join(paths.checkpoints, "step_4"))
    os.makedirs(os.path.join(paths.root, "eval"))  # their evaluation (mode=eval)
    check_existing(cfg(), paths)  # recover=auto continues it
    with pytest.raises(ConfigError, match="recover.overwrite=true"):
        check_existing(cfg("recover=off"), paths)
    check_existing(cfg("recover=off", "recover.overwrite=true"), paths, dry_run=True)
    assert os.path.isdir(paths.checkpoints)  # a dry run deletes nothing
    check_existing(cfg("recover=off", "recover.overwrite=true"), paths)
    assert not os.path.exists(paths.checkpoints)
    # recover.overwrite=true alone continued the trial and said nothing
    with pytest.raises(ConfigError, match=r"^recover\.overwrite=true starts a trial over, which "
                                          r"only recover=off does \(recover=auto continues"):
        cfg("recover.overwrite=true")
    assert not os.path.exists(os.path.join(paths.root, "eval"))
