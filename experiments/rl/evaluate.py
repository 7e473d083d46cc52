"""Greedy evaluation on the held-out prompts, through the generation servers."""
from __future__ import annotations

import hashlib
from typing import Any, Callable, NamedTuple

from experiments.rl.agents import Episode, SingleTurnAgent
from experiments.rl.config import RLConfig
from experiments.rl.data import Router
from experiments.rl.episodes import run_episodes, score
from experiments.rl.tasks import Prompt, get_task
from workers.generation import GenerationClient


class Evaluation(NamedTuple):
    accuracy: float
    """Mean reward of the greedy answers, in [0, 1] (NaN without prompts)."""
    digest: str
    """Fingerprint of every greedy completion's tokens, in prompt order: two evaluations with
    the same digest generated the same answers (the same weights, to within what greedy
    decoding can tell)."""


def evaluate(gens: dict[int, GenerationClient], rl: RLConfig, tok: Any, agent: SingleTurnAgent,
             router: Router, prompts: list[tuple[Prompt, list[int]]],
             alive: Callable[[int], bool] | None = None) -> Evaluation:
    """Greedy accuracy on the held-out prompts (rewards in [0, 1]), through the live servers
    (``gens``: by replica index; ``router`` picks among the live ones)."""
    if not prompts:
        return Evaluation(float("nan"), "")
    task = get_task(rl.task)
    episodes: list[tuple[Episode, int]] = []
    for _, ids in prompts:
        server = router.pick()
        episodes += [(ep, server) for ep in agent.episodes(ids, 1, greedy=True)]
    try:
        results = run_episodes(episodes, gens, rl.call_timeout, alive)
    finally:
        for _, server in episodes:
            router.done(server)
    total, digest = 0.0, hashlib.sha256()
    for (p, _), trajs in zip(prompts, results):
        score(trajs, tok, p["answer"], task.reward)
        total += trajs[0]["reward"]
        digest.update(trajs[0]["tokens"].astype("<i8").tobytes() + b"|")
    return Evaluation(total / len(prompts), digest.hexdigest()[:16])
