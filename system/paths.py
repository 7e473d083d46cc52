"""Where things live: this project's root and every path of one trial directory."""
from __future__ import annotations

import dataclasses
import os

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The project's root (where ``.models/`` and the sbatch templates are)."""


@dataclasses.dataclass(frozen=True)
class TrialPaths:
    """Every path of one trial: ``<fileroot>/<exp>/<trial>/``."""

    root: str

    @property
    def config(self) -> str:
        return os.path.join(self.root, "config.yaml")

    @property
    def bootstrap(self) -> str:
        return os.path.join(self.root, "bootstrap.json")

    @property
    def secret(self) -> str:
        return os.path.join(self.root, "secret")

    @property
    def api_key(self) -> str:
        """The generation servers' HTTP API key (mode 0600, see :mod:`system.api_key`)."""
        return os.path.join(self.root, "api_key")

    @property
    def lock(self) -> str:
        """Locked by the process that runs the trial's controller, for the trial's life."""
        return os.path.join(self.root, "lock")

    @property
    def summary(self) -> str:
        return os.path.join(self.root, "summary.json")

    @property
    def status(self) -> str:
        """``status.json``: the controller's record of the trial, rewritten every few seconds
        while it runs and once at the end (:mod:`system.launcher.status_file`)."""
        return os.path.join(self.root, "status.json")

    @property
    def cancel_request(self) -> str:
        """``cancel.json``: written by ``python -m system.ctl cancel`` (who asked, and when)."""
        return os.path.join(self.root, "cancel.json")

    @property
    def logs(self) -> str:
        return os.path.join(self.root, "logs")

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    def worker_log(self, kind: str, index: int, attempt: int = 0) -> str:
        """A worker's log; each automatic recovery's restarted workers log to their own."""
        suffix = f".attempt{attempt}" if attempt else ""
        return os.path.join(self.logs, f"{kind}-{index}{suffix}.log")

    @staticmethod
    def of(fileroot: str, exp: str, trial: str) -> "TrialPaths":
        return TrialPaths(os.path.abspath(os.path.join(fileroot, exp, trial)))
