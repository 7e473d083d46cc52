"""Evaluation on the held-out prompts, through the generation servers: greedy by default, or
``rl.eval_samples`` answers per prompt at ``rl.eval_temperature``, seeded per prompt (avg@k and
pass@k). An agent function written against the OpenAI API (``rl.agent.kind=openai``) is
evaluated as it runs: once per held-out prompt with its own sampling, unrecorded; the accuracy
is its mean reward."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Callable, NamedTuple

from experiments.rl.agents import Episode, SingleTurnAgent, make_agent, task_seed
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
    """Mean reward of the answers (each prompt's mean over its ``rl.eval_samples``, averaged:
    avg@k): the fraction right for 1/0 rewards (NaN without prompts)."""
    digest: str
    """Fingerprint of every completion's tokens, in prompt order: two evaluations with the same
    digest generated the same answers (the same weights, to within what greedy or seeded
    decoding can tell)."""
    pass_at_k: float | None = None
    """With ``rl.eval_samples`` k > 1: the mean of each prompt's best reward (pass@k for 1/0
    rewards)."""

    def figures(self) -> dict[str, Any]:
        """What ``metrics.jsonl`` logs of it: ``eval_accuracy``, ``eval_digest`` and, with k > 1,
        ``eval_pass_at_k``."""
        out: dict[str, Any] = {"eval_accuracy": self.accuracy, "eval_digest": self.digest}
        if self.pass_at_k is not None:
            out["eval_pass_at_k"] = self.pass_at_k
        return out


def eval_seed(seed: int, index: int) -> int:
    """The sampling seed of held-out prompt ``index`` (pure): apart from every training task's
    (:func:`~experiments.rl.agents.task_seed` of a negative number), the same at every
    evaluation, so the same weights give the same answers."""
    return task_seed(seed, -1 - index)


class EvalEpisode(NamedTuple):
    """One episode of the evaluation: whose prompt it answers, and its weight on a server
    (the samples its requests ask for: the router's load)."""

    episode: Episode
    prompt: int
    weight: int


def eval_episodes(rl: RLConfig, agent: SingleTurnAgent, tok: Any,
                  prompts: list[tuple[Prompt, list[int]]]) -> list[EvalEpisode]:
    """The episodes that answer every held-out prompt ``rl.eval_samples`` times (pure until
    driven): greedy, or the training rollouts' agent at ``rl.eval_temperature`` (top_p 1),
    seeded by :func:`eval_seed`."""
    k, greedy = rl.eval_samples, rl.eval_temperature == 0
    if not greedy:
        agent = make_agent(dataclasses.replace(agent.cfg, temperature=rl.eval_temperature,
                                               top_p=1.0), tok)
    out = []
    for i, (_, ids) in enumerate(prompts):
        eps = agent.episodes(ids, k, greedy=greedy,
                             seed=None if greedy else eval_seed(rl.seed, i))
        out += [EvalEpisode(ep, i, k // len(eps)) for ep in eps]  # (one of k, or k of one)
    return out


def scored(answers: list[list[Any]], digest: Any, k: int) -> Evaluation:
    """The figures of every prompt's rewarded answers (pure): avg@k, pass@k (k > 1), and the
    fingerprint of their tokens in prompt order."""
    mean, best = 0.0, 0.0
    for trajs in answers:
        rewards = [float(t["reward"]) for t in trajs]
        mean += sum(rewards) / len(rewards)
        best += max(rewards)
        for t in trajs:
            digest.update(t["tokens"].astype("<i8").tobytes() + b"|")
    n = max(len(answers), 1)
    return Evaluation(mean / n, digest.hexdigest()[:16], best / n if k > 1 else None)


def evaluate(gens: dict[int, GenerationClient], rl: RLConfig, tok: Any,
             agent: SingleTurnAgent | OpenAIAgent, router: Router,
             prompts: list[tuple[Prompt, list[int]]],
             alive: Callable[[int], bool] | None = None,
             watch: RewardWatch | None = None) -> Evaluation:
    """Accuracy (mean reward) on the held-out prompts, through the live servers (``gens``: by
    replica index; ``router`` picks among the live ones): greedy, or ``rl.eval_samples``
    answers each at ``rl.eval_temperature``."""
    if not prompts:
        return Evaluation(float("nan"), "")
    if isinstance(agent, OpenAIAgent):
        return Evaluation(evaluate_function(gens, rl, agent, router, prompts, alive), "")
    task = get_task(rl.task)
    planned = eval_episodes(rl, agent, tok, prompts)
    episodes: list[tuple[Episode, int]] = [(e.episode, router.pick(e.weight)) for e in planned]
    try:
        results = run_episodes(episodes, gens, rl.call_timeout, alive)
    finally:
        for e, (_, server) in zip(planned, episodes):
            router.done(server, e.weight)
    answers: list[list[Any]] = [[] for _ in prompts]
    for e, trajs in zip(planned, results):
        answers[e.prompt] += trajs
    for (p, _), trajs in zip(prompts, answers):
        score(trajs, tok, p["answer"], task.reward, watch=watch)
    return scored(answers, hashlib.sha256(), rl.eval_samples)


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
