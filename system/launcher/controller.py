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
from scheduler.base import GroupSpec, JobState, JobStatus, Scheduler
from system import names
from system.launcher.config import ExperimentConfig
from system.structs import plain
from system.errors import RLSystemError, RpcError, WorkerFailure
from system.name_resolve import NameResolve
from system.launcher.progress import Progress
from system.rpc import RpcClient
from system.launcher.trial_dir import now_iso, write_json_atomic
from system.paths import TrialPaths
from system.wire import Codec
from workers.client import WorkerClient, collect_settled
from workers.kinds import KINDS, client_for
from workers.schema import WorkerSetup

log = logging.getLogger("controller")


def group_specs(cfg: ExperimentConfig, paths: TrialPaths) -> dict[str, GroupSpec]:
    """Every worker group of the trial, by kind in start order (pure)."""
    python = cfg.scheduler.slurm.python or sys.executable
    return {kind: GroupSpec(kind, n, (python, "-m", "system.launcher.run_worker", "--trial-dir", paths.root,
                                      "--kind", kind),
                            {"PYTHONUNBUFFERED": "1"},
                            tuple(paths.worker_log(kind, i) for i in range(n)))
            for kind, n in ((k, cfg.worker_counts()[k]) for k in KINDS)}


def worker_configs(cfg: ExperimentConfig, experiment: Experiment) -> dict[str, WorkerSetup]:
    """What ``configure`` sends each kind: its own section, the experiment's, and the counts."""
    section = plain(getattr(cfg, experiment.section)) if experiment.section else {}
    return {kind: {"worker": plain(getattr(cfg, kind)), "experiment": section,
                   "counts": cfg.worker_counts(), "recover": getattr(cfg, "recover", "off")}
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
        self.groups = group_specs(cfg, paths)
        self.logs = {name: g.log_paths[i] for g in self.groups.values()
                     for i, name in enumerate(g.worker_names())}
        self.clients: dict[str, WorkerClient] = {}
        self.addresses: dict[str, str] = {}
        self.rejoining: dict[str, float] = {}  # worker -> deadline to register again
        self._restarts: dict[str, int] = {}
        self._incarnation: dict[str, int] = {}  # worker -> restart count it was configured at
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
            for group in self.groups.values():
                if group.count:
                    summary.setdefault("jobs", {})[group.kind] = self.scheduler.submit(group)
            self.timeline["submitted"] = time.time()
            self._wait_registered()
            self._configure()
            self._start()
            summary["results"] = self._watch()
            if isinstance(summary["results"], dict):  # the experiment's headline figures
                summary.update(summary["results"].get("summary") or {})
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
            if self._restarts:
                summary["restarts"] = dict(self._restarts)
            summary["end_time"] = now_iso()
            summary["duration_s"] = round(time.time() - self._t0, 3)
            summary["t0_epoch"] = self._t0
            summary["timeline_s"] = {k: round(v - self._t0, 3) for k, v in self.timeline.items()}
            write_json_atomic(self.paths.summary, summary)
        print(f"{summary['status']}: {self.paths.summary}", file=sys.stderr)
        return 0 if summary["status"] == "completed" else 1

    # --- phases ---
    def _check_jobs(self, phase: str, statuses: list[JobStatus] | None = None) -> None:
        for st in self.scheduler.poll() if statuses is None else statuses:
            if st.state.active:
                continue
            worker = st.workers[0] if st.workers else "?"
            logs = ", ".join(st.log_paths)
            how = f"{st.state.value}" + (f" ({st.detail})" if st.detail else "")
            tail = "\n".join(log_tail(p) for p in st.log_paths[:1])
            raise WorkerFailure(f"worker {', '.join(st.workers)} exited {phase}: {how}; "
                                f"log: {logs}" + (f"\n--- last lines ---\n{tail}" if tail else ""),
                                worker, st.log_paths[0] if st.log_paths else None)

    def _settled(self, statuses: list[JobStatus]) -> list[JobStatus]:
        """A requeued Slurm job can briefly show an ended state (its batch script is killed by
        the requeue) before it is pending again: with requeue on, give a job that looks ended a
        few seconds and ask again before judging it."""
        slurm = self.cfg.scheduler.slurm
        if self.cfg.scheduler.type.value != "slurm" or not slurm.requeue:
            return statuses
        deadline = time.monotonic() + 5.0
        while any(not s.state.active for s in statuses) and time.monotonic() < deadline:
            time.sleep(0.5)
            statuses = self.scheduler.poll(fresh=True)
        return statuses

    def _note_restarts(self, statuses: list[JobStatus]) -> None:
        """A requeued job's workers are rejoining: they will register again, at new addresses."""
        for st in statuses:
            if st.restarts > self._restarts.get(st.job_id, 0):
                self._restarts[st.job_id] = st.restarts
                deadline = time.monotonic() + self.cfg.scheduler.slurm.rejoin_timeout
                for w in st.workers:
                    if self._incarnation.get(w, -1) >= st.restarts:
                        continue  # already configured in its new incarnation (start-up)
                    self.rejoining[w] = deadline
                    client = self.clients.pop(w, None)
                    if client is not None:
                        client.close()
                print(f"\njob {st.job_id} ({', '.join(st.workers)}) was requeued "
                      f"(restart {st.restarts}); waiting for its workers to rejoin",
                      file=sys.stderr)

    def _rejoin(self) -> None:
        """Configure and start requeued workers once they registered again. A worker that
        registers at a new address was restarted, even if no poll caught its job pending (a
        requeued job can be running again within a second)."""
        prefix = names.worker_addresses(self.cfg.exp, self.cfg.trial)
        found = {k[len(prefix) + 1:]: v for k, v in self.nr.get_subtree(prefix).items()}
        moved = [w for w, a in found.items()
                 if w in self.addresses and a != self.addresses[w] and w not in self.rejoining]
        if moved:
            self._note_restarts(self.scheduler.poll(fresh=True))  # records the restart count
            deadline = time.monotonic() + self.cfg.scheduler.slurm.rejoin_timeout
            for w in moved:
                self.rejoining.setdefault(w, deadline)
                client = self.clients.pop(w, None)
                if client is not None:
                    client.close()
        if not self.rejoining:
            return
        back = [w for w in self.rejoining if w in found and found[w] != self.addresses.get(w)]
        for w in list(self.rejoining):
            if w not in back and time.monotonic() > self.rejoining[w]:
                raise WorkerFailure(f"requeued worker {w} did not rejoin within "
                                    f"{self.cfg.scheduler.slurm.rejoin_timeout:.0f}s; "
                                    f"log: {self.logs[w]}", w, self.logs[w])
        if not back:
            return
        clients = []
        for w in back:
            self.addresses[w] = found[w]
            self.clients[w] = client_for(w, RpcClient(self.codec, found[w],
                                                      self.cfg.rpc.request_timeout))
            clients.append(self.clients[w])
        self._configure_all(clients)
        self._start_all(clients)
        for w in back:
            del self.rejoining[w]
        print(f"\nrejoined: {', '.join(back)}", file=sys.stderr)

    def _check_reported_errors(self) -> None:
        errors = self.nr.get_subtree(names.worker_errors(self.cfg.exp, self.cfg.trial))
        for key, value in errors.items():
            worker = "/".join(key.split("/")[-2:])
            info = json.loads(value)
            log_path = self.logs.get(worker)
            raise WorkerFailure(
                f"worker {worker} raised {info['type']}: {info['message']}\n{info['traceback']}"
                f"log: {log_path or '?'}", worker, log_path)

    def _wait_registered(self) -> None:
        timeout = self.cfg.controller.register_timeout
        deadline = time.monotonic() + timeout
        prefix = names.worker_addresses(self.cfg.exp, self.cfg.trial)
        expected = set(self.logs)
        while True:
            found = {k[len(prefix) + 1:]: v for k, v in self.nr.get_subtree(prefix).items()}
            registered = expected & set(found)
            self.progress.update(registered=f"{len(registered)}/{len(expected)}")
            if registered == expected:
                break
            self._check_reported_errors()
            self._check_jobs("before registering", self._settled(self.scheduler.poll()))
            if time.monotonic() > deadline:
                missing = sorted(expected - registered)
                logs = "\n".join(f"  {w}: {self.logs[w]}" for w in missing)
                raise WorkerFailure(f"{len(missing)} worker(s) did not register within "
                                    f"{timeout:.0f}s: {', '.join(missing)}\n{logs}", missing[0],
                                    self.logs[missing[0]])
            time.sleep(0.02)
        self.timeline["registered"] = time.time()
        for name, address in found.items():
            if name in expected:
                self.addresses[name] = address
                self.clients[name] = client_for(
                    name, RpcClient(self.codec, address, self.cfg.rpc.request_timeout))

    def _ordered(self, kinds: tuple[str, ...] = tuple(KINDS)) -> list[WorkerClient]:
        """Clients of every worker of ``kinds``, in order, but those rejoining after a requeue
        (configured and started by :meth:`_rejoin` once they registered again)."""
        return [self.clients[w] for k in kinds for w in self.groups[k].worker_names()
                if w not in self.rejoining]

    def _start_all(self, clients: list[WorkerClient]) -> None:
        """Start every client at once (see :meth:`_check`)."""
        self._check(clients, "start", collect_settled([c.start() for c in clients],
                                                      self.cfg.rpc.request_timeout))

    def _configure_all(self, clients: list[WorkerClient]) -> None:
        """Configure every client at once; record the incarnation each answers from (before
        judging failures: a worker configured in its new incarnation is not waited for)."""
        configs = worker_configs(self.cfg, self.experiment)
        results = collect_settled([c.configure(configs[c.kind]) for c in clients],
                                  self.cfg.rpc.request_timeout)
        for c, r in zip(clients, results):
            if isinstance(r, dict):
                self._incarnation[c.name] = int(r["restart"])
        self._check(clients, "configure", results)

    def _check(self, clients: list[WorkerClient], method: str, results: list[Any]) -> None:
        """A failed call fails the trial unless the worker's job was requeued (preempted during
        start-up): it rejoins later instead."""
        for c, r in zip(clients, results):
            if isinstance(r, Exception) and not self._requeued(c.name):
                raise WorkerFailure(f"{method} of worker {c.name} failed: {r}; log: "
                                    f"{self.logs[c.name]}", c.name, self.logs[c.name])

    def _requeued(self, worker: str) -> bool:
        """Whether ``worker``'s job was requeued, asking the scheduler for up to
        ``scheduler.slurm.requeue_grace`` seconds (the batch script requeues once srun has
        returned, after every task's graceful stop)."""
        slurm = self.cfg.scheduler.slurm
        if self.cfg.scheduler.type.value != "slurm" or not slurm.requeue:
            return False
        deadline = time.monotonic() + slurm.requeue_grace
        while True:
            self._note_restarts(self.scheduler.poll(fresh=True))
            if worker in self.rejoining:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)

    def _configure(self) -> None:
        self._configure_all(self._ordered())
        self.timeline["configured"] = time.time()

    def _start(self) -> None:
        self._start_all(self._ordered(tuple(k for k in KINDS if k != "master")))
        self._start_all(self._ordered(("master",)))
        self.timeline["started"] = time.time()

    def _watch(self) -> dict[str, Any]:
        cc = self.cfg.controller
        hb_prefix = names.heartbeats(self.cfg.exp, self.cfg.trial)
        last_master_answer = time.monotonic()
        started = time.monotonic()
        while True:
            self._check_reported_errors()
            statuses = self._settled(self.scheduler.poll())
            self._note_restarts(statuses)
            self._check_jobs("before the trial completed", statuses)
            self._rejoin()
            beating = {k[len(hb_prefix) + 1:] for k in self.nr.find_subtree(hb_prefix)}
            dead = sorted(set(self.logs) - beating - set(self.rejoining))
            if dead:  # a requeue may explain it: ask the scheduler afresh before judging
                statuses = self._settled(self.scheduler.poll(fresh=True))
                self._note_restarts(statuses)
                self._check_jobs("before the trial completed", statuses)
                dead = [w for w in dead if w not in self.rejoining]
            if dead:
                raise WorkerFailure(
                    f"worker {', '.join(dead)} stopped heart-beating (no refresh within "
                    f"{cc.heartbeat_ttl:.1f}s); log: {self.logs[dead[0]]}", dead[0],
                    self.logs[dead[0]])
            if "master/0" in self.rejoining:
                ping: dict[str, Any] = {}
            else:
                master = self.clients["master/0"]
                try:
                    ping = master.ping().result(max(cc.poll_interval * 5, 1.0))
                    last_master_answer = time.monotonic()
                except RpcError:
                    if time.monotonic() - last_master_answer > cc.heartbeat_ttl:
                        raise WorkerFailure(f"master does not answer; log: {self.logs['master/0']}",
                                            "master/0", self.logs["master/0"]) from None
                    ping = {}
            state = ping.get("state")
            prog = ping.get("progress") or {}
            self.progress.update(running=len(beating), state=state,
                                 rejoining=len(self.rejoining) or None,
                                 **prog,
                                 time=f"{time.monotonic() - started:.1f}s")
            if state == "completed":
                self.timeline["completed"] = time.time()
                return master.report().result()["result"]
            if cc.timeout and time.monotonic() - started > cc.timeout:
                raise WorkerFailure(f"trial did not complete within controller.timeout="
                                    f"{cc.timeout:.0f}s")
            time.sleep(cc.poll_interval)

    def _stop_all(self) -> None:
        clients = list(self.clients.values())
        if clients:
            collect_settled([c.stop() for c in clients], 2.0)
        deadline = time.monotonic() + self.cfg.scheduler.stop_grace
        while time.monotonic() < deadline and any(
                s.state.active and s.state != JobState.UNKNOWN for s in self.scheduler.poll()):
            time.sleep(0.05)
        try:
            self.scheduler.stop_all(self.cfg.scheduler.stop_grace)
        except RLSystemError as e:
            print(f"\nerror while stopping: {e}", file=sys.stderr)
        for c in clients:
            c.close()
        try:
            self.nr.clear_subtree(names.trial_root(self.cfg.exp, self.cfg.trial))
        except Exception as e:  # the backend may be gone; keys expire on their own
            log.warning("could not clear name-resolve keys: %s", e)
        self.nr.close()
        self.timeline["stopped"] = time.time()


__all__ = ["Controller", "group_specs", "worker_configs"]
