"""The controller: submit worker groups, wait for registration, configure, start, watch, stop.

It treats every worker the same way: a job from the scheduler, an address and a heartbeat in
name resolution, and an RPC client. The trial completes only when the master reports completion;
any worker that dies, stops heart-beating or reports an exception fails the trial, and in every
case every job is stopped before :meth:`Controller.run` returns.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

from experiments.registry import Experiment
from scheduler.base import JobState, Scheduler, WorkerSpec
from system import names
from system.config import ExperimentConfig, plain
from system.errors import RpcError, WorkerFailure
from system.name_resolve import NameResolve
from system.progress import Progress
from system.rpc import RpcClient
from system.trial import TrialPaths, now_iso, write_json_atomic
from system.wire import Codec
from workers.client import WorkerClient, gather
from workers.kinds import KINDS

log = logging.getLogger("controller")


def worker_specs(cfg: ExperimentConfig, paths: TrialPaths) -> dict[str, list[WorkerSpec]]:
    """Every worker process of the trial, by kind in start order (pure)."""
    counts = cfg.worker_counts()
    specs: dict[str, list[WorkerSpec]] = {}
    for kind in KINDS:
        specs[kind] = [
            WorkerSpec(kind, i, [sys.executable, "-m", "workers.run", "--trial-dir", paths.root,
                                 "--kind", kind, "--index", str(i)],
                       {"PYTHONUNBUFFERED": "1", "RLSYS_WORKER_INDEX": str(i)},
                       paths.worker_log(kind, i))
            for i in range(counts[kind])]
    return specs


def worker_configs(cfg: ExperimentConfig, experiment: Experiment) -> dict[str, dict[str, Any]]:
    """What ``configure`` sends each kind: its own section, the experiment's, and the counts."""
    section = plain(getattr(cfg, experiment.section)) if experiment.section else {}
    return {kind: {"role": experiment.roles[kind], "worker": plain(getattr(cfg, kind)),
                   "experiment": section, "counts": cfg.worker_counts()}
            for kind in KINDS}


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Controller:
    def __init__(self, cfg: ExperimentConfig, experiment: Experiment, paths: TrialPaths,
                 scheduler: Scheduler, name_resolve: NameResolve, codec: Codec) -> None:
        self.cfg = cfg
        self.experiment = experiment
        self.paths = paths
        self.scheduler = scheduler
        self.nr = name_resolve
        self.codec = codec
        self.specs = worker_specs(cfg, paths)
        self.all_specs = {s.name: s for group in self.specs.values() for s in group}
        self.clients: dict[str, WorkerClient] = {}
        self.timeline: dict[str, float] = {}
        self.progress = Progress(f"{cfg.exp}/{cfg.trial}", cfg.controller.progress)
        self._t0 = time.time()

    # --- the whole trial ---
    def run(self) -> int:
        summary: dict[str, Any] = {
            "exp": self.cfg.exp, "trial": self.cfg.trial, "status": "failed",
            "start_time": now_iso(), "workers": self.cfg.worker_counts(),
            "scheduler": self.cfg.scheduler.type.value,
            "name_resolve": self.cfg.name_resolve.type.value}
        self.timeline["start"] = self._t0
        try:
            self.nr.clear_subtree(names.trial_root(self.cfg.exp, self.cfg.trial))
            for kind, group in self.specs.items():
                if group:
                    self.scheduler.submit(kind, group)
            self.timeline["submitted"] = time.time()
            self._wait_registered()
            self._configure()
            self._start()
            summary["results"] = self._watch()
            summary["status"] = "completed"
        except WorkerFailure as e:
            summary["failure"] = {"message": str(e), "worker": e.worker, "log": e.log_path}
            print(f"\nerror: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            summary["status"] = "interrupted"
            print("\ninterrupted: stopping every worker", file=sys.stderr)
        finally:
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup must finish
            try:
                self.progress.close()
                self._stop_all()
            finally:
                signal.signal(signal.SIGINT, old)
            summary["end_time"] = now_iso()
            summary["duration_s"] = round(time.time() - self._t0, 3)
            summary["t0_epoch"] = self._t0
            summary["timeline_s"] = {k: round(v - self._t0, 3) for k, v in self.timeline.items()}
            write_json_atomic(self.paths.summary, summary)
        print(f"{summary['status']}: {self.paths.summary}", file=sys.stderr)
        return 0 if summary["status"] == "completed" else 1

    # --- phases ---
    def _check_jobs(self, phase: str) -> None:
        for st in self.scheduler.poll():
            if st.state.active:
                continue
            worker = st.workers[0] if st.workers else "?"
            logs = ", ".join(st.log_paths)
            how = f"{st.state.value}" + (f" ({st.detail})" if st.detail else "")
            tail = "\n".join(log_tail(p) for p in st.log_paths[:1])
            raise WorkerFailure(f"worker {', '.join(st.workers)} exited {phase}: {how}; "
                                f"log: {logs}" + (f"\n--- last lines ---\n{tail}" if tail else ""),
                                worker, st.log_paths[0] if st.log_paths else None)

    def _check_reported_errors(self) -> None:
        errors = self.nr.get_subtree(names.worker_errors(self.cfg.exp, self.cfg.trial))
        for key, value in errors.items():
            worker = "/".join(key.split("/")[-2:])
            info = json.loads(value)
            spec = self.all_specs.get(worker)
            raise WorkerFailure(
                f"worker {worker} raised {info['type']}: {info['message']}\n{info['traceback']}"
                f"log: {spec.log_path if spec else '?'}", worker, spec.log_path if spec else None)

    def _wait_registered(self) -> None:
        timeout = self.cfg.controller.register_timeout
        deadline = time.monotonic() + timeout
        prefix = names.worker_addresses(self.cfg.exp, self.cfg.trial)
        expected = set(self.all_specs)
        while True:
            found = {k[len(prefix) + 1:]: v for k, v in self.nr.get_subtree(prefix).items()}
            registered = expected & set(found)
            self.progress.update(registered=f"{len(registered)}/{len(expected)}")
            if registered == expected:
                break
            self._check_reported_errors()
            self._check_jobs("before registering")
            if time.monotonic() > deadline:
                missing = sorted(expected - registered)
                logs = "\n".join(f"  {w}: {self.all_specs[w].log_path}" for w in missing)
                raise WorkerFailure(f"{len(missing)} worker(s) did not register within "
                                    f"{timeout:.0f}s: {', '.join(missing)}\n{logs}", missing[0],
                                    self.all_specs[missing[0]].log_path)
            time.sleep(0.02)
        self.timeline["registered"] = time.time()
        for name, address in found.items():
            if name in expected:
                self.clients[name] = WorkerClient(
                    RpcClient(self.codec, address, self.cfg.rpc.request_timeout), name)

    def _ordered(self, kinds: tuple[str, ...] = tuple(KINDS)) -> list[WorkerClient]:
        return [self.clients[s.name] for k in kinds for s in self.specs[k]]

    def _call_all(self, clients: list[WorkerClient], method: str,
                  args: list[dict[str, Any]] | None = None) -> None:
        results = gather(clients, method, self.cfg.rpc.request_timeout, args)
        for c, r in zip(clients, results):
            if isinstance(r, Exception):
                spec = self.all_specs[c.name]
                raise WorkerFailure(f"{method} of worker {c.name} failed: {r}; log: "
                                    f"{spec.log_path}", c.name, spec.log_path)

    def _configure(self) -> None:
        configs = worker_configs(self.cfg, self.experiment)
        clients = self._ordered()
        self._call_all(clients, "configure",
                       [{"config": configs[c.name.split("/")[0]]} for c in clients])
        self.timeline["configured"] = time.time()

    def _start(self) -> None:
        self._call_all(self._ordered(tuple(k for k in KINDS if k != "master")), "start")
        self._call_all(self._ordered(("master",)), "start")
        self.timeline["started"] = time.time()

    def _watch(self) -> dict[str, Any]:
        cc = self.cfg.controller
        master = self.clients["master/0"]
        hb_prefix = names.heartbeats(self.cfg.exp, self.cfg.trial)
        expected = set(self.all_specs)
        last_master_answer = time.monotonic()
        started = time.monotonic()
        while True:
            self._check_reported_errors()
            self._check_jobs("before the trial completed")
            beating = {k[len(hb_prefix) + 1:] for k in self.nr.find_subtree(hb_prefix)}
            dead = sorted(expected - beating)
            if dead:
                spec = self.all_specs[dead[0]]
                raise WorkerFailure(
                    f"worker {', '.join(dead)} stopped heart-beating (no refresh within "
                    f"{cc.heartbeat_ttl:.1f}s); log: {spec.log_path}", dead[0], spec.log_path)
            try:
                ping = master.ping(timeout=max(cc.poll_interval * 5, 1.0))
                last_master_answer = time.monotonic()
            except RpcError:
                if time.monotonic() - last_master_answer > cc.heartbeat_ttl:
                    spec = self.all_specs["master/0"]
                    raise WorkerFailure(f"master does not answer; log: {spec.log_path}",
                                        "master/0", spec.log_path) from None
                ping = {}
            state = ping.get("state")
            prog = ping.get("progress") or {}
            self.progress.update(running=len(beating), state=state,
                                 **{k: (f"{v}/{prog['total']}" if k != "total" and "total" in prog
                                        else v) for k, v in prog.items() if k != "total"},
                                 time=f"{time.monotonic() - started:.1f}s")
            if state == "completed":
                self.timeline["completed"] = time.time()
                return master.report()["result"]
            if cc.timeout and time.monotonic() - started > cc.timeout:
                raise WorkerFailure(f"trial did not complete within controller.timeout="
                                    f"{cc.timeout:.0f}s")
            time.sleep(cc.poll_interval)

    def _stop_all(self) -> None:
        clients = list(self.clients.values())
        if clients:
            gather(clients, "stop", 2.0)
        deadline = time.monotonic() + self.cfg.scheduler.stop_grace
        while time.monotonic() < deadline and any(
                s.state.active for s in self.scheduler.poll()):
            time.sleep(0.05)
        self.scheduler.stop_all(self.cfg.scheduler.stop_grace)
        for c in clients:
            c.close()
        try:
            self.nr.clear_subtree(names.trial_root(self.cfg.exp, self.cfg.trial))
        except Exception as e:  # the backend may be gone; keys expire on their own
            log.warning("could not clear name-resolve keys: %s", e)
        self.nr.close()
        self.timeline["stopped"] = time.time()


__all__ = ["Controller", "worker_specs", "worker_configs", "JobState"]
