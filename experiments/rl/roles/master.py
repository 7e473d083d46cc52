"""The master: the RL loop, read as a script (the steps are in :mod:`experiments.rl.loop`)."""
from __future__ import annotations

import time
from typing import Any

from experiments.rl.common import rl_config
from experiments.rl.loop import RLLoop
from workers.master import MasterWorker


def master_role(master: MasterWorker) -> dict[str, Any]:
    rl = rl_config(master)
    t_start = time.monotonic()
    loop = RLLoop(master, rl)
    master.set_progress(phase="loading engines")
    try:
        loop.start()
        while loop.state.step < rl.total_steps:
            loop.step()
        loop_seconds = loop.loop_seconds()
    finally:
        loop.close()
    return {"summary": loop.summary(t_start, loop_seconds),
            "prompts_per_step": loop.state.history, "dropped_stale": loop.buffer.dropped,
            "stream_drops": loop.puller.drops.as_dict()}
