"""Training metrics of a trial: TensorBoard events, a JSON-lines log and a PNG plot."""
from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger("rl-metrics")


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines log. A crash mid-write leaves a torn last line: it is dropped
    with a warning (as is any other unreadable line) rather than failing the resume."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                log.warning("%s line %d is unreadable (a write cut short?): dropped", path, n)
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                log.warning("%s line %d is not a row: dropped", path, n)
    return rows


class MetricsLog:
    def __init__(self, trial_dir: str, resume: bool = False) -> None:
        self.dir = trial_dir
        self.path = os.path.join(trial_dir, "metrics.jsonl")
        self.rows: list[dict[str, Any]] = []
        if resume and os.path.exists(self.path):
            self.rows = read_rows(self.path)
        elif os.path.exists(self.path):
            os.unlink(self.path)
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(os.path.join(trial_dir, "tensorboard"))

    def truncate(self, step: int) -> None:
        """Forget rows after ``step`` (a resumed run redoes them)."""
        self.rows = [r for r in self.rows if r.get("step", 0) <= step]
        tmp = self.path + ".tmp"  # replaced in one step: a crash here keeps the old log
        with open(tmp, "w") as f:
            for r in self.rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def log(self, step: int, **values: Any) -> None:
        row = {"step": step, **values}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(k.replace(".", "/"), v, step)
        self.tb.flush()

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in self.rows if key in r and r[key] is not None]

    def plot(self, path: str, title: str) -> str:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        reward = self.series("reward")
        if reward:
            ax.plot(*zip(*reward), label="training reward", color="tab:blue", lw=1)
        acc = self.series("eval_accuracy")
        if acc:
            ax.plot(*zip(*acc), "o-", label="eval accuracy (greedy)", color="tab:red")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self.tb.close()
