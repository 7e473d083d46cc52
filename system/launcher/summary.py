"""``summary.json``: what the launcher records of one trial (status, jobs, results, failure,
restarts, times), written atomically when the trial has stopped."""
from __future__ import annotations

import sys
import time
from typing import Any, Mapping

from system.errors import WorkerFailure
from system.launcher.config import ExperimentConfig
from system.launcher.trial_dir import now_iso, write_json_atomic


class TrialSummary:
    """The summary of one trial, filled in as it runs; ``status`` stays ``failed`` unless the
    trial completed, was interrupted, was cancelled, or requeued its detached controller."""

    def __init__(self, cfg: ExperimentConfig, t0: float) -> None:
        self.t0 = t0
        """Epoch seconds the trial began (timeline entries are relative to it)."""
        self.data: dict[str, Any] = {
            "exp": cfg.exp, "trial": cfg.trial, "status": "failed",
            "start_time": now_iso(), "workers": cfg.worker_counts(),
            "scheduler": cfg.scheduler.type.value,
            "name_resolve": cfg.name_resolve.type.value}

    @property
    def status(self) -> str:
        return self.data["status"]

    def submitted(self, kind: str, job_ids: list[str]) -> None:
        self.data.setdefault("jobs", {})[kind] = job_ids

    def completed(self, results: Any) -> None:
        """The master's report; a dict's ``summary`` holds the experiment's headline figures,
        and its ``warnings`` (lines) are printed: what the run left undone."""
        self.data["results"] = results
        if isinstance(results, dict):
            self.data.update(results.get("summary") or {})
            for line in (results.get("summary") or {}).get("warnings") or []:
                print(f"warning: {line}", file=sys.stderr)
        self.data["status"] = "completed"

    def failed(self, e: WorkerFailure) -> None:
        self.data["failure"] = {"message": str(e), "worker": e.worker, "log": e.log_path}

    def recoveries(self, attempts: list[dict[str, Any]]) -> None:
        """Each automatic recovery: its cause, the step it resumed from, the steps lost."""
        if attempts:
            self.data["recoveries"] = attempts

    def last_progress(self, progress: Mapping[str, Any]) -> None:
        """The master's last progress figures (``step``, ``reward``, ...) of a trial that did not
        complete: how far it got before it failed or was stopped."""
        if progress and self.status != "completed":
            self.data["progress"] = dict(progress)

    def interrupted(self, cancelled: bool = False) -> None:
        """Ctrl-C or a stop signal; ``cancelled``: ``python -m system.ctl cancel`` asked."""
        self.data["status"] = "cancelled" if cancelled else "interrupted"

    def requeued(self, job_id: str, record: Mapping[str, Any]) -> None:
        """The detached controller's own job (``job_id``) was warned of its time limit or
        preemption: the trial stopped and the job is requeued; the trial continues when Slurm
        starts it again. ``record``: ``checkpointed`` (the checkpoint it asked for first was
        committed), ``checkpoint_step`` (the newest committed one, which the trial continues
        from) and ``last_step`` (the last one trained)."""
        self.data["status"] = "requeued"
        self.data["requeued"] = {"job": job_id, **record}

    def finish(self, path: str, attempts: list[dict[str, Any]], progress: Mapping[str, Any],
               timeline: Mapping[str, float], restarts: Mapping[str, int]) -> bool:
        """The trial has stopped: add its recoveries and last progress, and write the summary
        to ``path``. Whether it was written: a failed write (a full disk, say) is printed, and
        the outcome is still returned by the caller."""
        self.recoveries(attempts)
        self.last_progress(progress)
        try:
            self.write(path, timeline, restarts)
        except OSError as e:
            print(f"could not write {path}: {e}", file=sys.stderr)
            return False
        return True

    def write(self, path: str, timeline: Mapping[str, float], restarts: Mapping[str, int]
              ) -> None:
        """Add the end, the duration, the ``timeline`` (epoch seconds per event) and the
        ``restarts`` per job (if any), and write the summary to ``path``."""
        if restarts:
            self.data["restarts"] = dict(restarts)
        self.data["end_time"] = now_iso()
        self.data["duration_s"] = round(time.time() - self.t0, 3)
        self.data["t0_epoch"] = self.t0
        self.data["timeline_s"] = {k: round(v - self.t0, 3) for k, v in timeline.items()}
        write_json_atomic(path, self.data)
