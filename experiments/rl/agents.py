"""Agents: how a prompt becomes trajectories through calls to a generation server.

An agent's :meth:`episodes` returns generators (episodes). Each yields a :class:`GenRequest`,
receives the list of samples the server returned, and finally returns its trajectories; the
rollout worker drives many episodes at once, so their calls share the server's batch. A
trajectory is ``{tokens, prompt_len, mask, logprobs, versions, finish}`` where the arrays after
``prompt_len`` cover the completion: ``mask`` 1 for tokens the policy generated, 0 for tool
output (which gets log-prob 0 and version -1 and is not trained on).

- :class:`SingleTurnAgent`: one call with ``n`` samples (a group for GRPO).
- :class:`CalculatorAgent`: multi-turn with a tool. When the model writes ``[expr]`` the turn
  stops at ``]``; the agent evaluates ``expr`` (integers, + - * / and parentheses) and appends
  the result as tool output; the model then continues, up to ``max_turns`` calls.

``kind=openai`` runs an agent function written against the OpenAI API instead
(``rl.agent.function``; :mod:`experiments.rl.openai_agent`).

Training rollouts are seeded: the rollout worker gives each task a seed of its own
(:func:`task_seed`, from ``rl.seed`` and the task's sequence number), and every request of its
episodes samples with a seed derived from it (:func:`request_seed`), so the same task samples
the same tokens from the same weights, whichever worker or server runs it and whatever it
shares the server's batch with.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import operator
from typing import Any, Generator, NamedTuple, Sequence

import numpy as np

from experiments.rl import plugins
from system.errors import ConfigError
from workers.engines.vllm_config import logprob_temperature
from workers.schema import Sample, SamplingParams, Trajectory

Episode = Generator["GenRequest", list[Sample], list[Trajectory]]

AGENT_KINDS = ("single", "calculator", "openai")
BUILTIN_FUNCTIONS = ("calculator",)
"""Agent functions ``rl.agent.function`` names without a plugin (see
:data:`experiments.rl.openai_agent.FUNCTIONS`)."""


def task_seed(seed: int, seq: int) -> int:
    """The base sampling seed of task ``seq`` in a run seeded ``seed`` (pure): 62 bits of a
    hash, so that two tasks' seeds do not meet (their requests add small offsets to it)."""
    digest = hashlib.blake2b(f"{seed}:{seq}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def request_seed(base: int | None, episode: int, turn: int, turns: int = 1) -> int | None:
    """The seed of turn ``turn`` (of at most ``turns``) of episode ``episode`` of a task seeded
    ``base`` (pure; None: unseeded). The server samples sample ``i`` of a request with
    ``seed + i``: one request of ``n`` samples (one episode) takes ``base`` .. ``base + n - 1``,
    and one-sample requests ``base + episode * turns + turn``."""
    return None if base is None else base + episode * turns + turn


@dataclasses.dataclass
class GenRequest:
    """One call an episode asks for: ``n`` samples of ``prompt`` on its generation server."""

    prompt: list[int]
    n: int
    sampling: SamplingParams


@dataclasses.dataclass
class AgentConfig:
    """The agent that runs each prompt."""

    kind: str = "single"
    """single (one call, n samples), calculator (multi-turn with a calculator tool), or openai
    (an agent function written against the OpenAI API, ``function``)."""
    function: str = ""
    """kind=openai: the agent function ``async def run(client, task) -> reward``: calculator
    (built in), or a plugin an installed package declares under the ``slurm_rl.agents``
    entry-point group, by its name or its ``module:function`` value."""
    max_new_tokens: int = 4
    """Completion budget per trajectory (tool output included), >= 1 and less than
    ``rl.vllm.max_model_len`` (kind=openai: the agent function asks for its own)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts, > 0 (evaluation: rl.eval_temperature).
    The policy trained is the tempered one: vLLM's log-probs and the trainer's are both taken
    at it (each token carries its temperature, ``Trajectory.temps``)."""
    top_p: float = 1.0
    """Nucleus sampling of training rollouts, in (0, 1]. Below 1 the behaviour log-probs are
    the truncated distribution's, the trainer's the whole tempered one's: the loss sees the
    truncation as off-policy sampling (the ratio starts at the nucleus's mass, not 1)."""
    max_turns: int = 4
    """Calculator agent: at most this many generation calls per trajectory (>= 1)."""
    seeded: bool = True
    """Training rollouts sample from seeds of their own (:func:`task_seed`): a sync run repeats
    bit for bit. False: the servers' shared random stream (vLLM then keeps no generator per
    sample; its sampler loops over those it keeps at every step)."""

    def __post_init__(self) -> None:
        if self.kind not in AGENT_KINDS:
            raise ConfigError(f"kind={self.kind!r} is not one of {', '.join(AGENT_KINDS)}")
        if self.kind == "openai":
            if not self.function:
                valid = plugins.valid_names(plugins.AGENT_GROUP, list(BUILTIN_FUNCTIONS))
                raise ConfigError("function is empty: kind=openai runs the agent function it "
                                  f"names; valid: {valid}")
            plugins.check(plugins.AGENT_GROUP, "function", self.function,
                          list(BUILTIN_FUNCTIONS))
        elif self.function:
            raise ConfigError(f"function={self.function!r} is only read with kind=openai "
                              f"(kind is {self.kind!r})")
        for key in ("max_new_tokens", "max_turns"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} is not valid for training "
                              "rollouts: a group's samples would all be the same (GRPO "
                              "advantages all 0) and their log-probs not the policy's; valid: "
                              "> 0 (evaluation samples greedily by itself)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} is not valid; valid: a number in (0, 1]")


class Part(NamedTuple):
    """A run of a trajectory's completion: what the policy sampled (``mask`` 1, at
    ``temperature``, the one its log-probs are at) or tool output (``mask`` 0)."""

    tokens: Any
    logprobs: Any
    versions: Any
    mask: int
    temperature: float = 1.0


def sampled(sample: Sample, sampling: SamplingParams) -> Part:
    """The part of a sample the policy generated with ``sampling``."""
    return Part(sample["tokens"], sample["logprobs"], sample["versions"], 1,
                logprob_temperature(float(sampling.get("temperature", 1.0))))


def _traj(prompt: Sequence[int], parts: Sequence[Part], finish: str) -> Trajectory:
    """Assemble a trajectory from parts; ``temps`` only where a part's temperature is not 1."""
    def cat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)

    toks = [np.asarray(p.tokens, dtype=np.int32) for p in parts]
    traj: Trajectory = {
        "tokens": np.concatenate([np.asarray(prompt, dtype=np.int32), cat(toks, np.int32)]),
        "prompt_len": len(prompt),
        "mask": cat([np.full(len(t), p.mask, np.int8) for t, p in zip(toks, parts)], np.int8),
        "logprobs": cat([np.asarray(p.logprobs, np.float32) for p in parts], np.float32),
        "versions": cat([np.asarray(p.versions, np.int32) for p in parts], np.int32),
        "finish": finish}
    if any(p.temperature != 1.0 for p in parts):
        traj["temps"] = cat([np.full(len(t), p.temperature, np.float32)
                             for t, p in zip(toks, parts)], np.float32)
    return traj


class SingleTurnAgent:
    def __init__(self, cfg: AgentConfig, tokenizer: Any = None) -> None:
        self.cfg = cfg

    def sampling(self, greedy: bool = False, seed: int | None = None) -> SamplingParams:
        params: SamplingParams = {"max_tokens": self.cfg.max_new_tokens,
                                  "temperature": 0.0 if greedy else self.cfg.temperature,
                                  "top_p": 1.0 if greedy else self.cfg.top_p}
        if seed is not None and not greedy:
            params["seed"] = seed
        return params

    def episodes(self, prompt: list[int], n: int, greedy: bool = False,
                 seed: int | None = None) -> list[Episode]:
        """The episodes of one task: ``n`` trajectories of ``prompt``, sampled from ``seed``
        (the task's :func:`task_seed`; None: the server's random stream)."""
        return [self._one(prompt, n, greedy, seed)]

    def _one(self, prompt: list[int], n: int, greedy: bool, seed: int | None) -> Episode:
        sampling = self.sampling(greedy, request_seed(seed, 0, 0))
        samples = yield GenRequest(prompt, n, sampling)
        return [_traj(prompt, [sampled(s, sampling)], s["finish"]) for s in samples]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv}


def calculate(expr: str) -> int | None:
    """Evaluate integer arithmetic safely (no names, calls or huge powers); ``None`` if invalid."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv)) and b == 0:
                raise ZeroDivisionError
            r = _OPS[type(node.op)](a, b)
            if abs(r) > 10 ** 12:
                raise OverflowError
            return r
        raise ValueError("unsupported")

    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


class CalculatorAgent(SingleTurnAgent):
    """Multi-turn: the model may call the calculator with ``[expr]`` (see the module doc)."""

    OPEN, CLOSE = "[", "]"

    def __init__(self, cfg: AgentConfig, tokenizer: Any) -> None:
        super().__init__(cfg)
        self.tok = tokenizer
        close = tokenizer.encode(self.CLOSE, add_special_tokens=False)
        if len(close) != 1:
            raise ConfigError(f"the calculator agent needs {self.CLOSE!r} to be one token")
        self.close_id = close[0]

    def episodes(self, prompt: list[int], n: int, greedy: bool = False,
                 seed: int | None = None) -> list[Episode]:
        return [self._episode(prompt, greedy, seed, e) for e in range(n)]

    def _episode(self, prompt: list[int], greedy: bool, seed: int | None,
                 episode: int) -> Episode:
        parts: list[Part] = []
        used, finish = 0, "length"
        for turn in range(self.cfg.max_turns):
            left = self.cfg.max_new_tokens - used
            if left <= 0:  # the budget ran out in tool output: cut, as a sample at it is
                finish = "length"
                break
            own = request_seed(seed, episode, turn, self.cfg.max_turns)
            sampling: SamplingParams = {**self.sampling(greedy, own), "max_tokens": left,
                                        "stop_token_ids": [self.close_id]}
            ids = list(prompt) + [int(t) for p in parts for t in p[0]]
            s = (yield GenRequest(ids, 1, sampling))[0]
            parts.append(sampled(s, sampling))
            used += len(s["tokens"])
            finish = s["finish"]
            toks = [int(t) for t in s["tokens"]]
            if not toks or toks[-1] != self.close_id:
                break  # the model ended its answer (or ran out of budget)
            text = self.tok.decode([int(t) for p in parts for t in p[0]])
            call = text[text.rfind(self.OPEN) + 1:-1] if self.OPEN in text else ""
            value = calculate(call) if call else None
            out = self.tok.encode("?" if value is None else str(value), add_special_tokens=False)
            out = out[:max(0, self.cfg.max_new_tokens - used)]
            if not out:  # (no room left for the tool's answer)
                finish = "length"
                break
            parts.append(Part(np.asarray(out, np.int32), np.zeros(len(out), np.float32),
                              np.full(len(out), -1, np.int32), 0))
            used += len(out)
        return [_traj(prompt, parts, finish)]


def make_agent(cfg: AgentConfig, tokenizer: Any) -> SingleTurnAgent:
    return CalculatorAgent(cfg, tokenizer) if cfg.kind == "calculator" else SingleTurnAgent(cfg)
