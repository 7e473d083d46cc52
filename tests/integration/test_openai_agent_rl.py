"""An arith-tiny trial whose rollouts are an agent function written against the OpenAI API
(the built-in calculator, ``rl.agent.kind=openai``): it trains from the sessions the
generation server recorded and completes."""
from __future__ import annotations

import json
import os

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import NO_SPARES, read_summary, run_launch, trial_processes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]


def test_an_openai_calculator_agent_trains_end_to_end(tmp_path):
    root = str(tmp_path)
    r = run_launch("exp=arith-tiny", "trial=oa", f"cluster.fileroot={root}",
                   "rl.agent.kind=openai", "rl.agent.function=calculator", "rl.total_steps=3",
                   "rl.batch_size=4", "rl.group_size=4", "rl.task.eval_size=4",
                   "rl.eval_interval=0", "controller.progress=false", NO_SPARES, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    s = read_summary(root, "arith-tiny", "oa")
    assert s["status"] == "completed" and s["steps"] == 3
    with open(os.path.join(root, "arith-tiny", "oa", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    trained = [row for row in rows if row["step"] > 0 and "reward" in row]
    assert len(trained) == 3 and all(0 <= row["reward"] <= 1 for row in trained)
    assert all(row["gen_tokens"] > 0 for row in trained)
    assert trial_processes(root) == []
