"""Agents written against the OpenAI API (``rl.agent.kind=openai``), run by rollout workers.

An agent function is ``async def run(client, task) -> float``: ``client`` is an
``openai.AsyncOpenAI`` whose ``base_url`` is ``<generation server>/sessions/<id>/v1`` and whose
``api_key`` is the trial's; ``task`` is the prompt record (``{"id", "prompt", "answer", ...}``);
the return value is the episode's reward. The session id rides in the URL path because every
agent framework takes a ``base_url`` and an ``api_key`` and passes them through unchanged (a
framework that builds its own client gets ``str(client.base_url)`` and ``client.api_key``),
while custom headers or a ``user`` field are not passed on by all of them.

For each task the rollout worker runs ``group_size`` calls concurrently (one asyncio loop for
all its tasks), then fetches and drops every session's recorded turns from its server
(``take_sessions``) and turns them into trajectories (:mod:`experiments.rl.sessions`), each
carrying its session's reward. A call that raises or returns something other than a finite
number fails its task's group (the master hands the prompt out again), as does a session that
made no request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import uuid
from typing import Any, Awaitable, Callable, Sequence

from experiments.rl import openai_calculator, plugins
from experiments.rl.agents import AgentConfig, SingleTurnAgent, make_agent
from experiments.rl.sessions import session_trajectories
from system.api_key import read_api_key
from system.errors import CallAbandoned, ConfigError, PeerDied, first_line
from system.paths import TrialPaths
from workers.schema import SessionRecord, Trajectory

AgentFunction = Callable[[Any, dict[str, Any]], Awaitable[float]]

FUNCTIONS: dict[str, AgentFunction] = {"calculator": openai_calculator.run}
"""The built-in agent functions, by the name ``rl.agent.function`` takes."""
ALIVE_EVERY = 0.5
"""Seconds between checks that the servers the sessions talk to still serve."""


def load_function(cfg: AgentConfig) -> AgentFunction:
    """The agent function ``rl.agent.function`` names (a built-in, or a declared plugin)."""
    fn = FUNCTIONS.get(cfg.function) or plugins.load(plugins.AGENT_GROUP, "rl.agent.function",
                                                     cfg.function)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"rl.agent.function={cfg.function!r} is not an async function "
                          "(async def run(client, task) -> float)")
    return fn


@dataclasses.dataclass
class Session:
    """One agent call: on ``server`` (an index), for ``task``; then its reward or error."""

    server: int
    task: dict[str, Any]
    record: bool = True
    """Record its requests (training); evaluation runs unrecorded."""
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    reward: float = 0.0
    error: str = ""


class OpenAIAgent:
    """Runs an agent function against generation servers' OpenAI endpoints."""

    def __init__(self, cfg: AgentConfig, api_key: str, timeout: float) -> None:
        self.fn = load_function(cfg)
        self.name = cfg.function
        self.api_key, self.timeout = api_key, timeout

    @classmethod
    def for_trial(cls, cfg: AgentConfig, trial_dir: str, timeout: float) -> "OpenAIAgent":
        """The agent of a trial: its endpoints take the key in ``<trial_dir>/api_key``."""
        return cls(cfg, read_api_key(TrialPaths(trial_dir).api_key), timeout)

    def run(self, sessions: Sequence[Session], http: dict[int, str],
            alive: Callable[[int], bool] | None = None,
            cut: Callable[[], bool] = lambda: False) -> None:
        """Run every session's call concurrently (``http``: endpoint address per server);
        sets each one's reward or error. A server that stops serving (``alive``) fails the
        whole run with :class:`~system.errors.PeerDied`; ``cut()`` saying the caller may wait
        no longer (a rollout worker stopped by a signal), with
        :class:`~system.errors.CallAbandoned`."""
        for name in ("httpx", "openai"):  # a line per request would flood the worker's log
            logging.getLogger(name).setLevel(logging.WARNING)
        asyncio.run(self._run(sessions, http, alive, cut))

    async def _run(self, sessions: Sequence[Session], http: dict[int, str],
                   alive: Callable[[int], bool] | None, cut: Callable[[], bool]) -> None:
        import openai

        base = openai.AsyncOpenAI(base_url=f"{next(iter(http.values()))}/v1",
                                  api_key=self.api_key, timeout=self.timeout, max_retries=2)
        try:
            calls = asyncio.gather(*(self._one(base, http[s.server], s) for s in sessions))
            watch = asyncio.ensure_future(_watch({s.server for s in sessions}, alive, cut))
            done, _ = await asyncio.wait({calls, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                calls.cancel()
                await asyncio.gather(calls, return_exceptions=True)
                watch.result()  # raises PeerDied or CallAbandoned
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            calls.result()
        finally:
            await base.close()

    async def _one(self, base: Any, address: str, s: Session) -> None:
        url = f"{address}/sessions/{s.id}/v1" if s.record else f"{address}/v1"
        try:  # (a function that never returns would hold the rollout worker for good)
            reward = await asyncio.wait_for(plugins.no_exit_async(
                self.fn(base.with_options(base_url=url), s.task)), self.timeout)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            s.error = (f"rl.agent.function={self.name!r} did not return within "
                       f"{self.timeout:.0f}s (rl.call_timeout)")
            return
        except Exception as e:  # the user's code: its error fails the group, named
            s.error = (f"rl.agent.function={self.name!r} raised {type(e).__name__}: "
                       f"{first_line(e)}")
            return
        value = plugins.finite_reward(reward)
        if value is None:
            s.error = (f"rl.agent.function={self.name!r} returned {str(reward)[:80]!r} "
                       f"({type(reward).__name__}), not a finite number")
            return
        s.reward = value


async def _watch(servers: set[int], alive: Callable[[int], bool] | None,
                 cut: Callable[[], bool]) -> None:
    while True:
        await asyncio.sleep(ALIVE_EVERY)
        if cut():
            raise CallAbandoned("the agent function's calls: cut short, this worker was "
                                "stopped by a signal and waits no longer")
        for server in servers if alive is not None else ():
            if not alive(server):
                raise PeerDied(f"generation server {server} stopped serving")


def group_trajectories(sessions: Sequence[Session], records: dict[str, SessionRecord]
                       ) -> tuple[list[Trajectory], str]:
    """One task's sessions (its group, in order) as trajectories with their rewards and
    session indices, or an error that fails the group."""
    trajs: list[Trajectory] = []
    for k, s in enumerate(sessions):
        if s.error:
            return [], s.error
        rec = records.get(s.id)
        got = session_trajectories(rec["turns"], s.reward, k) if rec else []
        if not got:
            return [], (f"prompt {s.task.get('id')}: session {k} recorded no "
                        "completion token (did the agent call the client it was given?)")
        trajs += got
    return trajs, ""


def trial_agent(cfg: AgentConfig, tokenizer: Any, trial_dir: str, timeout: float
                ) -> SingleTurnAgent | OpenAIAgent:
    """The agent a master (training or evaluating) runs prompts with: a generator agent, or an
    agent function against the endpoints of the servers of ``trial_dir``."""
    if cfg.kind == "openai":
        return OpenAIAgent.for_trial(cfg, trial_dir, timeout)
    return make_agent(cfg, tokenizer)
