"""Task, reward and agent plugins, found through installed packages' entry points.

A plugin is code an installed distribution declares, in its ``setup.cfg``::

    [options.entry_points]
    slurm_rl.tasks =
        paren = paren_task:make_task
    slurm_rl.rewards =
        strict = paren_task:strict_reward

and a config names it by its entry-point name (``rl.task.name=paren``) or by its value
(``rl.task.name=paren_task:make_task``). Nothing else is loaded: a value that no installed
distribution declares is refused at configuration, before anything is imported, so a config
value (which travels to every worker) can only pick code the machine's environment already
vouches for, never name arbitrary code (see ``test_no_package_imports_code_by_name``).
"""
from __future__ import annotations

import contextlib
import decimal
import math
import numbers
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Awaitable, Iterator, TypeVar

import numpy as np

from system.errors import ConfigError, first_line

T = TypeVar("T")

TASK_GROUP = "slurm_rl.tasks"
"""Entry points of task factories: ``factory(cfg: TaskConfig) -> Task``."""
REWARD_GROUP = "slurm_rl.rewards"
"""Entry points of reward functions: ``reward(completion: str, answer) -> float``."""
AGENT_GROUP = "slurm_rl.agents"
"""Entry points of agent functions written against the OpenAI API:
``async def run(client: openai.AsyncOpenAI, task: dict) -> float``."""


def declared(group: str) -> list[EntryPoint]:
    """The entry points installed distributions declare in ``group``."""
    return sorted(entry_points(group=group), key=lambda ep: ep.name)


def find(group: str, name: str) -> EntryPoint | None:
    """The entry point of ``group`` whose name or value (``module:attr``) is ``name``."""
    for ep in declared(group):
        if name in (ep.name, ep.value):
            return ep
    return None


def valid_names(group: str, builtins: list[str]) -> list[str]:
    return [*builtins, *(f"{ep.name} ({ep.value})" for ep in declared(group))]


def check(group: str, key: str, name: str, builtins: list[str]) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a built-in or a declared plugin."""
    if name in builtins or find(group, name) is not None:
        return
    raise ConfigError(f"{key}={name!r} is neither built in nor a plugin an installed package "
                      f"declares under the entry-point group {group!r}; valid: "
                      f"{valid_names(group, builtins)}")


def load(group: str, key: str, name: str) -> Any:
    """The object of the declared plugin ``name`` (imports its module)."""
    ep = find(group, name)
    if ep is None:
        raise ConfigError(f"{key}={name!r}: no such plugin under {group!r}; valid: "
                          f"{valid_names(group, [])}")
    try:
        with no_exit():
            obj = ep.load()
    except Exception as e:  # an installed plugin that does not import is a setup mistake
        raise ConfigError(f"{key}={name!r}: the plugin {ep.value!r} does not load: "
                          f"{type(e).__name__}: {first_line(e)}") from e
    if not callable(obj):
        raise ConfigError(f"{key}={name!r}: the plugin {ep.value!r} is a "
                          f"{type(obj).__name__}, not a function")
    return obj


def finite_reward(value: Any) -> float | None:
    """What a user's reward or agent function returned, as a float: any real number (int,
    float, numpy's numbers, Fraction, Decimal; ``True``/``False`` count as 1/0) that is
    finite as a float; None for anything else (a string, None, NaN, a complex number, an int
    too large for a float)."""
    if isinstance(value, (complex, np.complexfloating)) or not isinstance(
            value, (numbers.Real, np.number, np.bool_, decimal.Decimal)):
        return None
    try:
        f = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return f if math.isfinite(f) else None


class ExitCalled(RuntimeError):
    """A user's code (a task factory, reward or agent function, a plugin's module) called
    ``sys.exit`` (or ``exit()``). Left alone, it ended the worker as if its role had returned
    (exit 0: a master read as completed, restarted until its retries ran out, the cause named
    nowhere); raised instead, it is reported as an error of that code, by name."""


@contextlib.contextmanager
def no_exit() -> Iterator[None]:
    """Run a user's code: its ``SystemExit`` becomes :class:`ExitCalled`."""
    try:
        yield
    except SystemExit as e:
        raise ExitCalled(f"it called sys.exit({e.code!r})") from e  # (its frame, in the log)


async def no_exit_async(call: Awaitable[T]) -> T:
    """Await a user's coroutine: its ``SystemExit``, which asyncio would raise out of the event
    loop itself, becomes :class:`ExitCalled`."""
    with no_exit():
        return await call
