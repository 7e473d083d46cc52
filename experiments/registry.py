"""What an experiment is: a named config factory and the role each worker kind plays in it.

The experiments themselves are listed in :mod:`experiments.catalog`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, TypeVar

from system.bootstrap import Bootstrap
from system.errors import ConfigError
from system.launcher.config import ExperimentConfig
from workers.base import Worker
from workers.generation import GenerationServer
from workers.master import MasterWorker
from workers.model import ModelWorker
from workers.rollout import RolloutWorker

W = TypeVar("W", bound=Worker)
Role = Callable[[W], "dict[str, Any] | None"]
"""What a worker runs after ``start``: returns its result (sent back in ``report``)."""


@dataclasses.dataclass(frozen=True)
class Roles:
    """The role of every worker kind."""

    master: Callable[[MasterWorker], dict[str, Any] | None]
    model: Callable[[ModelWorker], dict[str, Any] | None]
    generation: Callable[[GenerationServer], dict[str, Any] | None]
    rollout: Callable[[RolloutWorker], dict[str, Any] | None]

    def of(self, kind: str) -> Callable[[Any], dict[str, Any] | None]:
        """The role of worker kind ``kind``: one of this registry's own fields, never an
        attribute looked up by an arbitrary name."""
        kinds = [f.name for f in dataclasses.fields(self)]
        if kind not in kinds:
            raise ConfigError(f"no role for worker kind {kind!r}; valid: {kinds}")
        return getattr(self, kind)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A named experiment: its config factory and the role each worker kind plays in it."""

    name: str
    make_config: Callable[[], ExperimentConfig]
    roles: Roles
    section: str | None = None
    """The experiment's own config section, sent to every worker."""
    eval_roles: Roles | None = None
    """The roles of an evaluation of the trial's checkpoints (``mode=eval``: the master and the
    generation servers run); None: the experiment has nothing to evaluate."""
    eval_done: Callable[[Any, str, str], str | None] | None = None
    """``mode=eval``, before anything starts, given the config, the trial's directory and the
    evaluation's (``<trial>/eval``): one line saying the trial's checkpoints are all evaluated
    already (the launcher prints it and exits 0), or None to run; ConfigError (one line, exit 2)
    when this config cannot evaluate them."""
    train_done: Callable[[Any, str], str | None] | None = None
    """Before a training launch that would continue an existing trial, given the config and
    the trial's directory: one line saying the trial is trained to its end already (the
    launcher prints it and exits 0, writing and starting nothing), or None to run."""
    resume_check: Callable[[Any, str], None] | None = None
    """Before a training launch that would continue an existing trial (``recover=auto`` or
    ``resume``), given the config and the trial's directory: ConfigError (one line) when the
    trial's checkpoint cannot be continued with this config; the launcher refuses (exit 2)
    before it writes or starts anything."""
    stateful: tuple[str, ...] = ()
    """Worker kinds that hold training state: when one dies (and ``recover=auto``), all of
    these restart from the latest checkpoint; the others stay up. A worker of any other kind
    that dies is restarted alone."""
    warm: Mapping[str, Callable[[Bootstrap], None]] = dataclasses.field(default_factory=dict)
    """Per worker kind, what it imports (and reads) before it is needed, given the trial's
    bootstrap: a warm spare (local scheduler, :mod:`scheduler.spares`) calls it before it forks
    the kind's first workers and its restarts."""
    prepare: Mapping[str, Callable[[Bootstrap], Any]] = dataclasses.field(default_factory=dict)
    """Per worker kind, what a warm spare builds ahead of a restart from the trial's files (a
    generation server's engine, say), in a forked child that then becomes the restarted worker
    and finds it as :attr:`~workers.base.Worker.prepared`."""

    def roles_for(self, mode: str) -> Roles:
        """The roles of a run in ``mode`` (``train`` or ``eval``)."""
        if mode == "train":
            return self.roles
        if mode == "eval" and self.eval_roles is not None:
            return self.eval_roles
        valid = ["train", "eval"] if self.eval_roles else ["train"]
        raise ConfigError(f"mode={mode!r} is not valid for experiment {self.name}"
                          + ("" if self.eval_roles or mode != "eval"
                             else " (it saves no checkpoints to evaluate)")
                          + f"; valid: {valid}")

    @property
    def doc(self) -> str:
        return (self.make_config.__doc__ or "").strip()



