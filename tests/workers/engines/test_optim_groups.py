from __future__ import annotations

from workers.engines.optim_groups import configured, reapply


def test_the_configured_settings_win_over_the_checkpoints_and_the_state_stays():
    groups = [{"params": [1], "lr": 0.05, "betas": (0.9, 0.95), "weight_decay": 0.0, "step": 3},
              {"params": [2], "lr": 0.05, "betas": (0.9, 0.95), "weight_decay": 0.1}]
    mine = configured(groups)
    for g in groups:  # what loading the checkpoint's param groups does
        g.update(lr=0.0005, betas=(0.9, 0.999), step=7)
    assert reapply(groups, mine) == ["lr 0.0005 -> 0.05", "betas (0.9, 0.999) -> (0.9, 0.95)"]
    assert [(g["lr"], g["betas"], g.get("step")) for g in groups] == [
        (0.05, (0.9, 0.95), 7), (0.05, (0.9, 0.95), 7)]  # (a group's own counters: restored)
    assert reapply(groups, configured(groups)) == []
