"""What a model worker's warm spare imports follows the trial's engine: megatron-core's modules
for ``rl.actor.backend=megatron`` (every worker of a tp x pp x dp layout is forked from that
spare), none of them for FSDP."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from system.paths import PROJECT_ROOT

# (in a fresh process: what the warm-up imported, not what this test process had already)
CODE = """
import sys, types
from omegaconf import OmegaConf
from experiments.rl import warm
from system.launch import build_config
from system.paths import TrialPaths

trial_dir = sys.argv[1]
for backend in ("fsdp", "megatron"):  # (the first leaves megatron-core's modules unimported)
    cfg = build_config("arith-tiny", "w", [f"rl.actor.backend={backend}"])
    with open(TrialPaths(trial_dir).config, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    before = set(sys.modules)
    warm.WARM["model"](types.SimpleNamespace(experiment="arith-tiny", trial_dir=trial_dir))
    print(backend, sorted(m for m in ("megatron.core.pipeline_parallel", "torch",
                                      "workers.engines.megatron_engine")
                          if m in set(sys.modules) - before))
"""


def test_a_model_spare_imports_the_engine_of_the_trial(tmp_path):
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    if not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")):
        pytest.skip("the arith-tiny model is created by scripts/setup.sh")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CODE, str(tmp_path)],
                         capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == [
        "fsdp ['torch']",
        "megatron ['megatron.core.pipeline_parallel', 'workers.engines.megatron_engine']"]
