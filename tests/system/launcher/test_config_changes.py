"""A continued trial names the settings its launch changes from the last one's config.yaml (a
relaunch that forgot ``rl.keep_checkpoints=0`` pruned the older checkpoints without a word)."""
from __future__ import annotations

import os

from omegaconf import OmegaConf

from experiments.rl.checkpoint_layout import layout_of
from system.launch import build_config
from system.launcher.config_changes import SHOWN, changed_settings, describe, flatten
from tests.experiments.rl.test_checkpoint_layout import checkpoint
from tests.helpers import run_launch
from workers.engines.configs import TorchEngineConfig


def _yaml(*overrides: str, trial: str = "t") -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(build_config("arith-tiny", trial,
                                                               list(overrides))))


def test_changed_settings_are_named_with_both_values():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": [1, 2],
                                                                 "d": None}
    before = _yaml("rl.total_steps=8", "rl.keep_checkpoints=0")
    now = _yaml("rl.total_steps=10", "rl.task.train_path=/d/a b.jsonl")
    assert changed_settings(before, now) == ["rl.keep_checkpoints: 0 -> 2",
                                             "rl.task.train_path: '' -> /d/a b.jsonl",
                                             "rl.total_steps: 8 -> 10"]
    assert changed_settings(before, before) == []
    # an enum's name and a number-like string show as typed, not quoted as YAML would
    assert changed_settings(_yaml("recover=off"), _yaml("recover=resume")) == [
        "recover.type: OFF -> RESUME"]
    assert changed_settings("a: '1.0'\nb: ''\nc: ' x'", "a: '2'\nb: y\nc: z") == [
        "a: 1.0 -> 2", "b: '' -> y", "c: ' x' -> z"]
    assert changed_settings("x: {a: 1}", "x: {b: [1, 2]}") == ["x.a: 1 -> (none)",
                                                                "x.b: (none) -> [1, 2]"]
    assert changed_settings("not: [yaml", now) == changed_settings("- a list", now) == []
    text = describe("arith-tiny/t", [f"k{i}: 0 -> 1" for i in range(SHOWN + 3)])
    lines = text.splitlines()
    assert lines[0] == f"arith-tiny/t continues with {SHOWN + 3} setting(s) changed since its " \
                       "last launch:"
    assert len(lines) == SHOWN + 2 and lines[-1] == "  ... and 3 more (see config.yaml)"
    assert describe("arith-tiny/t", []) == ""


def test_a_relaunch_that_continues_names_what_it_changes(fileroot):
    trial_dir = os.path.join(fileroot, "arith-tiny", "c")
    checkpoint(os.path.join(trial_dir, "checkpoints"), 4, layout_of(TorchEngineConfig(), 1))
    with open(os.path.join(trial_dir, "config.yaml"), "w") as f:
        f.write(_yaml("rl.total_steps=8", "rl.keep_checkpoints=0",
                      f"cluster.fileroot={fileroot}", trial="c"))
    words = ("exp=arith-tiny", "trial=c", f"cluster.fileroot={fileroot}", "--dry-run")
    r = run_launch(*words, "rl.total_steps=12", timeout=120)
    assert r.returncode == 0, r.stderr
    assert ("arith-tiny/c continues with 2 setting(s) changed since its last launch:\n"
            "  rl.keep_checkpoints: 0 -> 2\n  rl.total_steps: 8 -> 12\n") in r.stderr
    # the same settings again: nothing to say; starting over compares with nothing
    r = run_launch(*words, "rl.total_steps=8", "rl.keep_checkpoints=0", timeout=120)
    assert r.returncode == 0 and "continues with" not in r.stderr, r.stderr
    r = run_launch(*words, "recover=off", "recover.overwrite=true", timeout=120)
    assert r.returncode == 0 and "continues with" not in r.stderr, r.stderr
