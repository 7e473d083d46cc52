"""Rollouts that can never succeed do not hang a trial. A training prompt too long for the
generation servers' context (``rl.vllm.max_model_len``) is skipped, counted in
``prompts_skipped``, and training goes on (it was handed out again for ever, every failure a
traceback in the logs). A reward function that returns NaN stops the trial in one line naming
it (its groups were dropped by the master's stream check, silently, and their prompts held until
their leases ran out: the trial hung at its first step). So does an agent function that always
fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import NO_SPARES, read_summary, run_launch, trial_processes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]

SMALL = ("rl.total_steps=3", "rl.batch_size=4", "rl.group_size=4", "rl.eval_interval=0",
         "rl.task.eval_size=4", "controller.progress=false", NO_SPARES)


def test_a_prompt_too_long_for_the_servers_is_skipped_and_training_goes_on(fileroot, tmp_path):
    train = tmp_path / "train.jsonl"
    with open(train, "w") as f:  # 5 sums, and one of 603 tokens (arith-tiny: 128 at most)
        for a, b in ((1, 1), (1, 2), (2, 2), (0, 3), (3, 1)):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n")
        f.write(json.dumps({"prompt": "1+" * 300 + "1=", "answer": 301}) + "\n")
    r = run_launch("exp=arith-tiny", "trial=long", f"cluster.fileroot={fileroot}",
                   f"rl.task.train_path={train}", *SMALL, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = read_summary(fileroot, "arith-tiny", "long")
    assert s["status"] == "completed" and s["steps"] == 3
    trained = {pid for step in s["results"]["prompts_per_step"] for pid, _ in step}
    assert trained == {0, 1, 2, 3, 4}  # 12 prompts drawn from 5 (the long one, id 5, never)
    root = os.path.join(fileroot, "arith-tiny", "long")
    with open(os.path.join(root, "metrics.jsonl")) as f:
        assert [json.loads(line).get("prompts_skipped") for line in f][-1] == 1
    with open(os.path.join(root, "logs", "master-0.log")) as f:
        skipped = [ln for ln in f if "is skipped" in ln]
    assert len(skipped) == 1 and "prompt 5 of the training set" in skipped[0]
    assert "exceeds rl.vllm.max_model_len=128" in skipped[0]


def _plugin(tmp: str, module: str, code: str, entry_points: str) -> str:
    """A package of one module ``module`` (``code``) declaring ``entry_points`` (setup.cfg
    lines), installed with pip into a directory of its own (as
    tests/experiments/rl/plugin_site.py does)."""
    src, site = os.path.join(tmp, "src"), os.path.join(tmp, "site")
    os.makedirs(src)
    with open(os.path.join(src, f"{module}.py"), "w") as f:
        f.write(code)
    with open(os.path.join(src, "setup.cfg"), "w") as f:
        f.write(f"[metadata]\nname = {module.replace('_', '-')}\nversion = 0.1\n[options]\n"
                f"py_modules = {module}\n[options.entry_points]\n{entry_points}")
    with open(os.path.join(src, "pyproject.toml"), "w") as f:
        f.write('[build-system]\nrequires = ["setuptools>=68", "wheel"]\n'
                'build-backend = "setuptools.build_meta"\n')
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", site, src],
                   check=True, capture_output=True, timeout=120)
    return site


def test_a_reward_that_returns_nan_stops_the_trial_in_one_line(fileroot, tmp_path):
    site = _plugin(str(tmp_path / "plugin"), "nan_reward",
                   "def reward(completion, answer):\n    return float('nan')\n",
                   "slurm_rl.rewards =\n    nan = nan_reward:reward\n")
    r = run_launch("exp=arith-tiny", "trial=nan", f"cluster.fileroot={fileroot}",
                   "rl.task.reward=nan", *SMALL, timeout=300, env={"PYTHONPATH": site})
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "raised ConfigError: the reward function nan_reward.reward " \
        "(rl.task.reward, or the task's own) returned 'nan'" in errors[0], r.stderr[-3000:]
    assert "recovering" not in r.stderr
    assert trial_processes(os.path.join(fileroot, "arith-tiny", "nan")) == []


def test_an_agent_function_that_always_fails_stops_the_trial_in_one_line(fileroot, tmp_path):
    """Its groups failed and their prompts were handed out again for ever (a warning each)."""
    site = _plugin(str(tmp_path / "plugin"), "broken_agent",
                   "async def run(client, task):\n    raise TypeError('a bug')\n",
                   "slurm_rl.agents =\n    broken = broken_agent:run\n")
    r = run_launch("exp=arith-tiny", "trial=agent", f"cluster.fileroot={fileroot}",
                   "rl.agent.kind=openai", "rl.agent.function=broken", *SMALL, timeout=300,
                   env={"PYTHONPATH": site})
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "raised ConfigError: rl.agent.function='broken' failed on the last 24 groups in a row "
        "(none succeeded in between); the last: rl.agent.function='broken' raised TypeError: "
        "a bug"), r.stderr[-3000:]
    assert "recovering" not in r.stderr
    root = os.path.join(fileroot, "arith-tiny", "agent")
    with open(os.path.join(root, "logs", "master-0.log")) as f:
        log = f.read()
    assert log.count("is skipped: its group failed 3 times in the agent function") <= 8
    assert trial_processes(root) == []
