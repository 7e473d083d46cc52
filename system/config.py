"""The root experiment config, composed of the dataclasses each component owns.

Every section validates itself at construction (``__post_init__`` raising
:class:`~system.errors.ConfigError` that names the key). Experiments extend
:class:`ExperimentConfig` with a section of their own (e.g. ``smoke``).
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import re
import textwrap
from typing import Any

from scheduler.base import SchedulerConfig
from system.errors import ConfigError
from system.name_resolve import NameResolveConfig
from system.rpc import RpcConfig
from workers.generation import GenerationServerConfig
from workers.master import MasterConfig
from workers.model import ModelWorkerConfig
from workers.rollout import RolloutWorkerConfig

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclasses.dataclass
class ClusterConfig:
    """Where the trial's files live and which network interface its sockets use."""

    fileroot: str = "./runs"
    """Root of trial directories (``<fileroot>/<exp>/<trial>/``); a shared filesystem on a cluster."""
    interface: str = ""
    """Address sockets bind to; empty: loopback under the local scheduler, the node's address
    under Slurm."""

    def __post_init__(self) -> None:
        if not self.fileroot:
            raise ConfigError("cluster.fileroot must not be empty")


@dataclasses.dataclass
class ControllerConfig:
    """The controller that starts, watches and stops the workers."""

    register_timeout: float = 120.0
    """Seconds to wait for every worker to register before giving up (naming the missing ones)."""
    heartbeat_ttl: float = 5.0
    """Seconds after which a worker whose heartbeat key was not refreshed counts as dead."""
    poll_interval: float = 0.2
    """Seconds between checks of job states, heartbeats and master progress."""
    timeout: float = 0.0
    """Stop the trial as failed after this many seconds (0: no limit)."""
    progress: bool = True
    """Show a live one-line progress display in the launching terminal."""

    def __post_init__(self) -> None:
        for key in ("register_timeout", "heartbeat_ttl", "poll_interval"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"controller.{key} must be > 0, got {getattr(self, key)}")
        if self.timeout < 0:
            raise ConfigError(f"controller.timeout must be >= 0, got {self.timeout}")


@dataclasses.dataclass
class ExperimentConfig:
    """The root config of one trial."""

    exp: str = ""
    """Experiment name (set by ``exp=NAME``)."""
    trial: str = ""
    """Trial name (set by ``trial=T``); the trial directory is ``<fileroot>/<exp>/<trial>``."""
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    """Paths and network."""
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    """How jobs are started (``scheduler=local|slurm``)."""
    name_resolve: NameResolveConfig = dataclasses.field(default_factory=NameResolveConfig)
    """How workers find each other (``name_resolve=file|redis``)."""
    rpc: RpcConfig = dataclasses.field(default_factory=RpcConfig)
    """Sockets and wire limits."""
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    """Registration, liveness and progress."""
    master: MasterConfig = dataclasses.field(default_factory=MasterConfig)
    """The master worker."""
    model: ModelWorkerConfig = dataclasses.field(default_factory=ModelWorkerConfig)
    """Model (training) workers."""
    generation: GenerationServerConfig = dataclasses.field(default_factory=GenerationServerConfig)
    """Generation servers."""
    rollout: RolloutWorkerConfig = dataclasses.field(default_factory=RolloutWorkerConfig)
    """Rollout workers."""

    def __post_init__(self) -> None:
        for key in ("exp", "trial"):
            value = getattr(self, key)
            if value and not _NAME_RE.match(value):
                raise ConfigError(f"{key}={value!r} must be letters, digits, '_', '-' or '.'")

    def worker_counts(self) -> dict[str, int]:
        return {"master": 1, "model": self.model.count, "generation": self.generation.count,
                "rollout": self.rollout.count}


def plain(obj: Any) -> Any:
    """Dataclasses, enums and containers as plain JSON/msgpack-able values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs
