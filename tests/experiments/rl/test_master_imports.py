"""A master (and a rollout worker) runs without torch: its modules, the advantages, the metrics
log with TensorBoard, and the tokenizer load import none (torch costs 1.5-4.5 CPU-s of a start
on two cores, while every worker of the trial starts at once)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from system.paths import PROJECT_ROOT

CODE = """
import sys
import numpy as np
import experiments.rl.loop, experiments.rl.roles.rollout, experiments.rl.roles.evaluator
from experiments.rl.config import RLConfig
from experiments.rl.metrics import MetricsLog
from experiments.rl.shaping import advantages_grpo, advantages_ppo
from experiments.rl.tokenizer import load_tokenizer

trajs = [{"prompt_len": 2, "mask": np.ones(3, np.float32), "reward": r} for r in (1.0, 0.0)]
advantages_grpo([trajs], 2)
advantages_ppo(trajs, [np.zeros(4, np.float32)] * 2, RLConfig(algorithm="ppo"))
log = MetricsLog(sys.argv[2])
log.log(1, reward=0.5)
log.close()
load_tokenizer(sys.argv[1])
print(sorted(m for m in ("torch", "transformers.models.auto.modeling_auto") if m in sys.modules))
"""


def test_a_master_and_a_rollout_worker_import_no_torch(tmp_path):
    model = os.path.join(PROJECT_ROOT, ".models", "arith-tiny")
    if not os.path.isfile(os.path.join(model, "tokenizer.json")):
        pytest.skip("the models are created by scripts/setup.sh")
    out = subprocess.run([sys.executable, "-c", CODE, model, str(tmp_path)], capture_output=True, text=True,
                         cwd=PROJECT_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"]
