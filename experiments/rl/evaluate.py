"""Greedy evaluation on the held-out prompts, through the generation servers. An agent function
written against the OpenAI API (``rl.agent.kind=openai``) is evaluated as it runs: once per
held-out prompt with its own sampling, unrecorded; the accuracy is its mean reward."""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, NamedTuple

from experiments.rl.agents import Episode, SingleTurnAgent
from experiments.rl.config import RLConfig
from experiments.rl.data import Router
from experiments.rl.episodes import run_episodes, score
from experiments.rl.openai_agent import OpenAIAgent, Session
from experiments.rl.reward_watch import RewardWatch
from experiments.rl.tasks import Prompt, get_task
from system.errors import ConfigError
from workers.generation import GenerationClient

log = logging.getLogger("rl-eval")


class Evaluation(NamedTuple):
    accuracy: float
    """Mean reward of the greedy answers: the fraction right for 1/0 rewards (NaN without
    prompts)."""
    digest: str
    """Fingerprint of every greedy completion's tokens, in prompt order: two evaluations with
    the same digest generated the same answers (the same weights, to within what greedy
    decoding can tell)."""


def evaluate(gens: dict[int, GenerationClient], rl: RLConfig, tok: Any,
             agent: SingleTurnAgent | OpenAIAgent, router: Router,
             prompts: list[tuple[Prompt, list[int]]],
             alive: Callable[[int], bool] | None = None,
             watch: RewardWatch | None = None) -> Evaluation:
    """Greedy accuracy (mean reward) on the held-out prompts, through the live servers
    (``gens``: by replica index; ``router`` picks among the live ones)."""
    if not prompts:
        return Evaluation(float("nan"), "")
    if isinstance(agent, OpenAIAgent):
        return Evaluation(evaluate_function(gens, rl, agent, router, prompts, alive), "")
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
        score(trajs, tok, p["answer"], task.reward, watch=watch)
        total += trajs[0]["reward"]
        digest.update(trajs[0]["tokens"].astype("<i8").tobytes() + b"|")
    return Evaluation(total / len(prompts), digest.hexdigest()[:16])


def evaluate_function(gens: dict[int, GenerationClient], rl: RLConfig, agent: OpenAIAgent,
                      router: Router, prompts: list[tuple[Prompt, list[int]]],
                      alive: Callable[[int], bool] | None) -> float:
    """The mean reward of one unrecorded run of the agent function per held-out prompt (a run
    that raises counts 0)."""
    sessions = [Session(router.pick(), dict(p), record=False) for p, _ in prompts]
    try:
        http = {}
        for r in sorted({s.server for s in sessions}):
            address = gens[r].engine_stats().result(rl.call_timeout).get("http")
            if not address:
                raise ConfigError("rl.agent.kind=openai needs generation.http=true")
            http[r] = address
        agent.run(sessions, http, alive)
    finally:
        for s in sessions:
            router.done(s.server)
    for s in sessions:
        if s.error:
            log.warning("evaluation of prompt %s: %s", s.task.get("id"), s.error)
    return sum(s.reward for s in sessions) / len(sessions)
