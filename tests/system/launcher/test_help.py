"""``--help`` lists every key of the config at every depth, each with its documentation."""
from __future__ import annotations

import re

import pytest

from experiments.catalog import all_experiments
from system.launcher.help import help_text
from system.launcher.help import leaf_keys, walk
from tests.helpers import run_launch

EXPERIMENTS = sorted(all_experiments())


def _documented(text: str) -> dict[str, str]:
    """``key -> the doc lines under it`` from the help text."""
    out, key = {}, None
    for line in text.splitlines():
        m = re.match(r"  (\S+) = ", line)
        if m:
            key = m.group(1)
            out[key] = ""
        elif key and line.startswith(" " * 6):
            out[key] += " " + line.strip()
        else:
            key = None
    return out


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_leaf_key_is_listed_with_its_doc(exp):
    cfg = all_experiments()[exp].make_config()
    shown = _documented(help_text(exp))
    keys = leaf_keys(cfg)
    assert [k for k in keys if k not in shown] == []
    undocumented = [k.path for k in walk(cfg) if not k.doc]
    assert undocumented == [], "add a docstring after each of these fields"
    for k in walk(cfg):
        if not k.section:  # the doc's first words, after the key
            assert " ".join(k.doc.split()[:4]) in shown[k.path], k.path


def test_deep_sections_are_listed():
    text = help_text("arith-tiny")
    for key in ("rl.vllm.tensor_parallel_size", "rl.vllm.gpu_memory_utilization",
                "rl.loss.kl_coef", "rl.weight_sync.mode", "rl.task.fields", "rl.task.reward",
                "metrics.wandb", "scheduler.slurm.model.partition",
                "scheduler.slurm.generation.env", "scheduler.slurm.controller.time"):
        assert f"\n  {key} = " in text, key
    assert "scheduler.type = 'local'  (one of: local, slurm)" in text


def test_help_without_an_experiment_lists_every_experiments_keys():
    text = help_text()
    shown = _documented(text)
    for exp in EXPERIMENTS:
        missing = [k for k in leaf_keys(all_experiments()[exp].make_config())
                   if k not in shown]
        assert missing == [], exp
    assert "keys of arith-tiny, smollm2-arith only" in text


def test_cli_help_of_an_experiment():
    r = run_launch("exp=arith-tiny", "--help")
    assert r.returncode == 0, r.stderr
    assert "\n  rl.weight_sync.bucket_mb = 256\n" in r.stdout
