"""Atomic checkpoint directories: ``<trial>/checkpoints/step_<N>/`` plus a ``latest`` pointer.

A checkpoint is written into ``step_<N>.tmp/`` by every party (model workers write their
engines, the master its own state), then renamed in one step and the ``latest`` file replaced
atomically; a crash at any point leaves the previous checkpoint as the latest. Older complete
checkpoints beyond ``keep`` are removed.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any


class CheckpointDir:
    def __init__(self, root: str, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        os.makedirs(root, exist_ok=True)

    def staging(self, step: int) -> str:
        path = os.path.join(self.root, f"step_{step}.tmp")
        if os.path.exists(path):
            shutil.rmtree(path)
        os.makedirs(path)
        return path

    def commit(self, step: int, meta: dict[str, Any]) -> str:
        """Publish the staged checkpoint of ``step``."""
        tmp, final = os.path.join(self.root, f"step_{step}.tmp"), self.path(step)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step}, f)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = os.path.join(self.root, "latest.tmp")
        with open(pointer, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(self.root, "latest"))
        self._prune(step)
        return final

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}")

    def latest(self) -> int | None:
        try:
            with open(os.path.join(self.root, "latest")) as f:
                step = int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return None
        return step if os.path.isfile(os.path.join(self.path(step), "meta.json")) else None

    def _prune(self, newest: int) -> None:
        steps = sorted(int(d[5:]) for d in os.listdir(self.root)
                       if d.startswith("step_") and d[5:].isdigit())
        for s in steps[:-self.keep] if self.keep > 0 else []:
            if s != newest:
                shutil.rmtree(self.path(s), ignore_errors=True)
        for d in os.listdir(self.root):  # stale staging dirs of earlier crashes
            if d.endswith(".tmp") and d != f"step_{newest}.tmp" and d.startswith("step_"):
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)
