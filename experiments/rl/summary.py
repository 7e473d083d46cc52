"""The headline figures of an RL run, which the controller copies into ``summary.json``."""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from experiments.rl.config import RLConfig
from experiments.rl.metrics import MetricsLog
from experiments.rl.state import LoopState


def run_summary(rl: RLConfig, state: LoopState, metrics: MetricsLog, trial_dir: str, title: str,
                resumed_from: int | None, notes: list[str], t_start: float,
                loop_seconds: float) -> dict[str, Any]:
    """``loop_seconds`` and ``samples_per_s`` over every master that trained the trial (a
    resumed one's alone said 0 samples/s when it had no step left to train). The reward
    figures and plot are the training reward's, ``rollout_reward``'s with dynamic sampling
    (a filtered batch's reward leaves out the groups all right or all wrong: it would read the
    filtering as learning). Closes ``metrics``."""
    series = "rollout_reward" if rl.dynamic_sampling else "reward"
    rewards = [r for _, r in metrics.series(series)]
    plot = metrics.plot(os.path.join(trial_dir, "reward.png"), title, series)
    metrics.close()
    first3 = float(np.mean(rewards[:3])) if rewards else None
    last3 = float(np.mean(rewards[-3:])) if rewards else None
    evals = metrics.series("eval_accuracy")  # (none without held-out prompts)
    return {"reward_first3": first3, "reward_last3": last3,
            "reward_gain": None if last3 is None or first3 is None else last3 - first3,
            "reward_series": series, "filtered_groups": state.filtered,
            "eval_accuracy_before": state.eval_before,
            "eval_accuracy_after": evals[-1][1] if evals else None,
            "mode": rl.mode, "algorithm": rl.algorithm,
            "max_staleness_used": state.max_staleness, "max_head_offpolicyness": rl.eta,
            "steps": state.step, "resumed_from_step": resumed_from,
            "samples_per_s": state.consumed * rl.group_size / max(loop_seconds, 1e-9),
            "loop_seconds": loop_seconds, "total_seconds": time.monotonic() - t_start,
            "plot": plot, "tensorboard": os.path.join(trial_dir, "tensorboard"),
            **({"warnings": notes} if notes else {})}
