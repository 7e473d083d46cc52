"""Driving agent episodes against generation servers, and scoring what they produce."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np

from experiments.rl.agents import Episode, GenRequest
from experiments.rl.plugins import finite_reward, no_exit
from experiments.rl.reward_watch import RewardWatch
from system.errors import CallAbandoned, ConfigError, PeerDied, RemoteError, first_line
from workers.client import Pending
from workers.generation import GenerationClient
from workers.schema import Sample, Trajectory

log = logging.getLogger("rl-episodes")

ALIVE_EVERY = 0.5
"""Seconds between checks that a generation server a request waits on is still the one serving
(a name-resolution read): its death re-issues the request within this time."""


def run_episodes(episodes: Sequence[tuple[Episode, int]], clients: dict[int, GenerationClient],
                 timeout: float, alive: Callable[[int], bool] | None = None,
                 cut: Callable[[], bool] = lambda: False) -> list[list[Trajectory]]:
    """Drive episodes (``(generator, server)``) together: every round submits each live
    episode's request to its server, then feeds back the samples. Returns each episode's
    trajectories. ``alive(server)``, asked every :data:`ALIVE_EVERY` seconds while a call
    waits, fails the call at once when its server died (:class:`~system.errors.PeerDied`);
    ``cut()``, asked as often, abandons it once the caller may wait no longer (a rollout worker
    whose job ends soon: :class:`~system.errors.CallAbandoned`)."""
    results: list[list[Trajectory] | None] = [None] * len(episodes)
    pending: dict[int, GenRequest] = {i: next(ep) for i, (ep, _) in enumerate(episodes)}
    while pending:
        if cut():  # (a fast round is never waited on: not one more submitted after the cut)
            raise CallAbandoned("generate: cut short before the next round, this worker was "
                                "stopped by a signal and waits no longer")
        calls: dict[int, Pending[list[Sample]]] = {
            i: clients[episodes[i][1]].generate(r.prompt, r.n, r.sampling)
            for i, r in pending.items()}
        nxt: dict[int, GenRequest] = {}
        for i, call in calls.items():
            server = episodes[i][1]
            try:
                samples = call.result_while(
                    lambda: not cut() and (alive is None or alive(server)), timeout, ALIVE_EVERY)
            except PeerDied:
                if not cut():
                    raise
                raise CallAbandoned(f"generate on generation server {server}: cut short, this "
                                    "worker was stopped by a signal and waits no longer") from None
            try:
                nxt[i] = episodes[i][0].send(samples)
            except StopIteration as stop:
                results[i] = stop.value
        pending = nxt
    return results  # type: ignore[return-value]


REWARD_RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
"""Seconds waited before each retry of a reward function that failed transiently
(:func:`transient`): a verifier or sandbox service it calls, briefly down."""


class RewardUnavailable(RuntimeError):
    """A reward function failed transiently on every try: the rollout worker fails (and is
    restarted, the prompt handed out again), as for any failure that may pass."""


TRANSIENT_TYPES = ("TransportError", "APIConnectionError")
"""Exception classes (by name, anywhere in the type's bases) of HTTP clients whose errors are
not ``OSError``s but are a connection or time-out failure: httpx's ``TransportError``, the
``openai`` client's ``APIConnectionError`` (and its ``APITimeoutError``)."""

_FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def transient(e: BaseException) -> bool:
    """Whether a reward function's exception may pass if asked again: a connection or time-out
    error, it or what it was raised from (``OSError``, which ``requests``' errors are, and
    ``TimeoutError``; httpx's and openai's, :data:`TRANSIENT_TYPES`), but not a file that is
    missing or unreadable, nor an HTTP answer refusing the request (a 4xx status), which will be
    so again."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if any(c.__name__ in TRANSIENT_TYPES for c in type(x).__mro__):
            return True
        if isinstance(x, OSError) and not isinstance(x, _FILE_ERRORS):
            status = getattr(getattr(x, "response", None), "status_code", None)
            return not (isinstance(status, int) and status < 500)
        x = x.__cause__ or x.__context__
    return False


def unservable(e: BaseException) -> bool:
    """Whether a generation server refused a request for good: it raised a ConfigError (the
    prompt and ``max_tokens`` do not fit ``rl.vllm.max_model_len``, say), which asking again
    cannot change."""
    return isinstance(e, RemoteError) and e.type_name == "ConfigError"


def score(trajs: list[Trajectory], tok: Any, answer: Any,
          reward_fn: Callable[[str, Any], float],
          delays: Sequence[float] = REWARD_RETRY_DELAYS,
          watch: RewardWatch | None = None) -> None:
    """Reward each trajectory on its final answer: the policy's last turn (after the last tool
    output; for a single-turn agent, the whole completion). A reward function that raises, or
    returns anything but a finite number (``True``/``False`` count as 1/0), is a ConfigError
    naming it (the same completion would fail it again: the trial stops in one line, not
    retried or recovered); one that fails transiently (:func:`transient`) is asked again after
    each of ``delays``, then :class:`RewardUnavailable`."""
    for t in trajs:
        comp = t["tokens"][t["prompt_len"]:]
        tool = np.nonzero(t["mask"] == 0)[0]
        final = comp[tool[-1] + 1:] if len(tool) else comp
        text = tok.decode([int(x) for x in final], skip_special_tokens=True)
        reward = _reward(reward_fn, text, answer, delays, watch)
        value = finite_reward(reward)
        if value is None:
            raise ConfigError(f"the reward function {_name(reward_fn)} (rl.task.reward, or the "
                              f"task's own) returned {str(reward)[:40]!r} "
                              f"({type(reward).__name__}) on the completion {text[:60]!r} "
                              f"(answer {str(answer)[:40]!r}); valid: a finite number")
        t["reward"] = value


def _reward(reward_fn: Callable[[str, Any], float], text: str, answer: Any,
            delays: Sequence[float], watch: RewardWatch | None = None) -> Any:
    for attempt in range(len(delays) + 1):
        try:
            if watch is None:
                with no_exit():
                    return reward_fn(text, answer)
            with watch.watching(f"the reward function {_name(reward_fn)} (rl.task.reward, or "
                                f"the task's own), on the completion {text[:60]!r} (answer "
                                f"{str(answer)[:40]!r}),"), no_exit():
                return reward_fn(text, answer)
        except Exception as e:
            what = (f"the reward function {_name(reward_fn)} (rl.task.reward, or the task's "
                    f"own) raised {type(e).__name__}: {first_line(e)} on the completion "
                    f"{text[:60]!r} (answer {str(answer)[:40]!r})")
            if not transient(e):
                raise ConfigError(what) from e
            if attempt == len(delays):
                raise RewardUnavailable(f"{what}, {attempt + 1} times in "
                                        f"{sum(delays):.0f}s") from e
            log.warning("%s; asking again in %.0fs", what, delays[attempt])
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
