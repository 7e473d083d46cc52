"""Training metrics of a trial: a JSON-lines log, TensorBoard events, a PNG plot and, when
``metrics.wandb`` is on, a Weights & Biases run (offline: under ``<trial>/wandb``)."""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

from system import json_text
from system.errors import ConfigError, first_line
from system.launcher.config import MetricsConfig

log = logging.getLogger("rl-metrics")


class WandbRun:
    """One W&B run per trial process that logs (the master); its charts use ``step``. A run
    W&B refuses for its settings (online without an API key, a key it rejects) is a
    ConfigError naming ``metrics.wandb``: starting the master again cannot change it."""

    def __init__(self, cfg: MetricsConfig, trial_dir: str, name: str) -> None:
        import wandb

        try:
            self.run = wandb.init(
                mode=cfg.wandb, dir=trial_dir, project=cfg.wandb_project,
                entity=cfg.wandb_entity or None, name=name, group=name.split("/")[0],
                config={"trial_dir": trial_dir},
                settings=wandb.Settings(console="off", x_disable_stats=True))
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            raise ConfigError(
                f"metrics.wandb={cfg.wandb}: W&B refused the run ({type(e).__name__}: "
                f"{first_line(e)}); log in (wandb login, or WANDB_API_KEY in the workers' "
                f"environment), or set metrics.wandb=offline") from e
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **{k.replace(".", "/"): v for k, v in values.items()}})

    def close(self) -> None:
        self.run.finish()


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
    def __init__(self, trial_dir: str, resume: bool = False,
                 cfg: MetricsConfig | None = None, name: str = "") -> None:
        self.dir = trial_dir
        self.path = os.path.join(trial_dir, "metrics.jsonl")
        self.rows: list[dict[str, Any]] = []
        self.tb_dir = os.path.join(trial_dir, "tensorboard")
        if resume and os.path.exists(self.path):
            self.rows = read_rows(self.path)
        elif not resume:  # a run started over: none of the last one's figures are this run's
            if os.path.exists(self.path):
                os.unlink(self.path)
            shutil.rmtree(self.tb_dir, ignore_errors=True)
        self.tb: Any = None  # the TensorBoard writer, opened at the first row
        self._purge_step: int | None = None
        cfg = cfg or MetricsConfig()
        self.wandb = (WandbRun(cfg, trial_dir, name or os.path.basename(trial_dir))
                      if cfg.wandb != "off" else None)

    def _writer(self) -> Any:
        if self.tb is None:
            from experiments.rl.tb_events import ScalarWriter

            self.tb = ScalarWriter(self.tb_dir, purge_step=self._purge_step)
        return self.tb

    def truncate(self, step: int) -> None:
        """Forget rows after ``step`` (a resumed run redoes them), in TensorBoard too (events
        of later steps are hidden, as ``purge_step`` does)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        self._purge_step = step + 1
        self.rows = [r for r in self.rows if r.get("step", 0) <= step]
        tmp = self.path + ".tmp"  # replaced in one step: a crash here keeps the old log
        with open(tmp, "w") as f:
            for r in self.rows:
                f.write(json_text.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def log(self, step: int, **values: Any) -> None:
        row = {"step": step, **values}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json_text.dumps(row) + "\n")
        scalars = {k: v for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for k, v in scalars.items():
            self._writer().add_scalar(k.replace(".", "/"), v, step)
        self._writer().flush()
        if self.wandb is not None:
            self.wandb.log(step, scalars)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in self.rows if key in r and r[key] is not None]

    def plot(self, path: str, title: str, reward_key: str = "reward") -> str:
        """The reward (``reward_key``'s series) and evaluation accuracy per step, as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        reward = self.series(reward_key)
        if reward:
            label = ("training reward" if reward_key == "reward"
                     else "rollout reward (every group, filtered or not)")
            ax.plot(*zip(*reward), label=label, color="tab:blue", lw=1)
        acc = self.series("eval_accuracy")
        if acc:
            ax.plot(*zip(*acc), "o-", label="eval accuracy", color="tab:red")
        best = self.series("eval_pass_at_k")
        if best:
            ax.plot(*zip(*best), "s--", label="eval pass@k", color="tab:orange")
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
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
