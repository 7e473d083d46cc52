"""The master's RL loop, one step at a time.

Per step: take B groups from the buffer (admission keeps rollouts within eta versions, the
buffer drops any that still got too old), compute proximal / reference log-probs and advantages,
train, publish weights every ``sync_interval`` steps, evaluate every ``eval_interval`` steps and
checkpoint every ``save_interval`` steps or ``save_interval_s`` seconds. Sync mode is the same
loop with eta = 0: no rollout may start before the weights it must use are published, so every
batch is generated, then trained.
:func:`experiments.rl.roles.master.master_role` drives it.
"""
from __future__ import annotations

import functools
import logging
import os
import random
import time
from typing import Any

import numpy as np

from experiments.rl.admission import AdmissionConfig, AdmissionController, TrajectoryBuffer
from experiments.rl.agent_failures import PROMPT_TRIES, AgentFailures
from experiments.rl.checkpoint import CheckpointDir
from experiments.rl.checkpoint_layout import check_resume_layout, layout_of
from experiments.rl.cluster import Cluster
from experiments.rl.common import eval_prompts, group_version, load_tokenizer, model_path, \
    reward_watch, save_tokenizer
from experiments.rl.config import RLConfig
from experiments.rl.data import PromptCursor, Router, TaskSource, describe_tasks
from experiments.rl.episodes import unservable
from experiments.rl.evaluate import Evaluation, evaluate
from experiments.rl.group_filter import UniformGroups
from experiments.rl.metrics import MetricsLog
from experiments.rl.openai_agent import trial_agent
from experiments.rl.state import MASTER_STATE, Admitted, LoopState, load_state, save_state
from experiments.rl.summary import run_summary
from experiments.rl.tasks import dataset
from experiments.rl.train_step import check_behaviour_logprobs, train_step
from system import names
from system.errors import ConfigError, RpcError
from system.launcher.config import MetricsConfig
from system.streams import StreamPuller
from workers.master import MasterWorker
from workers.checkpoint_window import PREEMPT_READ_S, WindowCheck
from workers.schema_check import group_message_problem

log = logging.getLogger("rl-master")


class RLLoop:
    """Everything the master's loop holds: state, admission, buffer, prompts, workers."""

    def __init__(self, master: MasterWorker, rl: RLConfig) -> None:
        self.master, self.rl = master, rl
        self.path = model_path(master, rl)
        self.tok = load_tokenizer(self.path)
        self.trial_dir = master.boot.trial_dir
        self.ckpt = CheckpointDir(os.path.join(self.trial_dir, "checkpoints"),
                                  rl.keep_checkpoints)
        self.ckpt.discard_staging()  # a checkpoint the last run left half-written
        random.seed(rl.seed)
        np.random.seed(rl.seed)
        self.layout = layout_of(rl.actor, int(master.config["counts"]["model"]))
        self.resumed_from = self.resume_point()
        # the master's own state is checked first (it is small; the model workers check the
        # rest, the engines, which may take minutes: a master that failed on a corrupt state
        # before they were done had every recovery fail alike, the checkpoint never marked)
        self.state = (load_state(self.ckpt.restorable(self.resumed_from, only=(MASTER_STATE,)))
                      if self.resumed_from is not None else LoopState())
        self.metrics = MetricsLog(self.trial_dir, resume=self.resumed_from is not None,
                                  cfg=MetricsConfig(**master.config.get("metrics", {})),
                                  name=f"{master.exp}/{master.trial}")
        self.metrics.truncate(self.state.step)
        self.admission = AdmissionController(AdmissionConfig(rl.batch_size, rl.eta))
        self.buffer = TrajectoryBuffer(rl.eta)
        self.buffer.dropped = self.state.dropped_stale  # (the counters: over the whole trial)
        if self.state.staleness_bound not in (None, rl.eta):  # the figure is per bound
            log.info("rl.max_head_offpolicyness is %d now (%d before): staleness measured "
                     "afresh", rl.eta, self.state.staleness_bound)
            self.state.max_staleness = 0
        self.state.staleness_bound = rl.eta
        for item, version in self.state.buffer:
            self.buffer.put(item, version, int(item.group["seq"]))
        self.admission.restore(self.state.step, self.state.consumed, len(self.state.buffer),
                               self.state.issued)
        cursor = PromptCursor([p["id"] for p in dataset(rl.task, "train")], rl.seed)
        if self.state.cursor:
            cursor.restore(self.state.cursor, self.ckpt.path(self.state.step))
        self.cluster = Cluster(master, rl)
        self.router = Router(self.cluster.n_gen)
        self.source = TaskSource(self.admission, cursor, self.router, rl.group_size,
                                 rl.lease_timeout)
        self.source.expired = self.state.leases_expired
        self.source.released = self.state.leases_released
        self.uniform = UniformGroups(rl.dynamic_sampling, rl.batch_size, rl.max_filtered_batches,
                                     self.state.filtered)
        self.published = 0  # the weight version the servers hold (the base model's: 0)
        self.agent_failures = AgentFailures(rl.batch_size)
        self.puller = StreamPuller(master.codec, master.host, master.rpc_cfg.stream_hwm,
                                   validate=functools.partial(group_message_problem,
                                                            group_size=rl.group_size))
        master.name_resolve.add(names.stream(master.exp, master.trial, "trajectories"),
                                self.puller.address, replace=True)
        self.agent = trial_agent(rl.agent, self.tok, master.boot.trial_dir, rl.call_timeout)
        self.held_out = eval_prompts(rl, self.tok)
        self.reward_watch = reward_watch(master, rl.task.reward_timeout)
        self.samples_at_start = self.state.consumed * rl.group_size
        self.seconds_at_start = self.state.loop_seconds  # (the earlier masters' loop time)
        self.t_loop = time.monotonic()
        self._heartbeats_read_at = 0.0  # rollout heartbeats are read at most once a second
        self._replicas_read_at = 0.0    # and generation servers' too
        self._preempts_read_at = 0.0    # and the preemption requests
        self._last_save: float | None = None  # when the last checkpoint was committed
        self._last_cost: float | None = None  # how long it took (seconds)
        # (does a checkpoint fit what the warned workers, and a detached controller, wait)
        self.window = WindowCheck(master.boot.preempt_warning, master.boot.controller_stop_grace)

    def start(self) -> None:
        """Wait for the engines, join the weight-sync groups, give the servers a restored
        checkpoint's weights, evaluate once, and open admission."""
        t0 = time.monotonic()
        self.cluster.wait_ready(self.rl.startup_timeout)
        t1 = time.monotonic()
        infos = self.cluster.on_models(lambda c: c.engine_info())
        self.cluster.init_weight_sync(self.path, infos)
        self.router.set_live(self.cluster.live)
        t2 = time.monotonic()
        if self.state.step > 0 or self.master.config["recover"] == "resume":
            # the servers hold the base model, or (after a recovery) newer weights than the
            # checkpoint's: give them the weights training continues from
            self.publish()
        log.info("start-up: engines ready in %.1fs, weight sync joined in %.1fs, weights "
                 "published in %.1fs", t1 - t0, t2 - t1, time.monotonic() - t2)
        self.master.set_progress(phase="starting", resumed_from=self.state.step)
        if self.state.eval_before is None and self.held_out:  # (none: nothing to evaluate)
            self.master.set_progress(phase="evaluating", resumed_from=self.state.step)
            before = self.evaluate()
            self.state.eval_before = before.accuracy
            self.metrics.log(0, **before.figures())
        self.t_loop = time.monotonic()
        self.master.set_progress(phase="training", resumed_from=self.state.step)  # (step 1)
        self.master.serve_tasks(self.source)  # rollouts begin

    def evaluate(self) -> Evaluation:
        """Accuracy through the live servers; a server that dies meanwhile leaves routing and
        the evaluation runs again on the others (it is deterministic: greedy, or seeded)."""
        while True:
            self.wait_for_replica()
            gens = {r: self.cluster.gens[r] for r in self.cluster.live}
            try:
                return evaluate(gens, self.rl, self.tok, self.agent, self.router, self.held_out,
                                self.gen_alive, self.reward_watch)
            except RpcError as e:
                if unservable(e):  # asking again cannot change it
                    raise ConfigError(f"a held-out prompt cannot be evaluated: {e}") from e
                log.warning("evaluation failed (%s): again on the live servers", e)
                self.watch_replicas(force=True)

    def publish(self) -> dict[str, float]:
        """The current weights to every live server (one that fails leaves routing)."""
        out = self.cluster.publish(self.state.step, alive=self.gen_alive)
        self.published = self.state.step
        self.router.set_live(self.cluster.live)
        return out

    def gen_alive(self, replica: int) -> bool:
        return self.cluster.serving(replica)

    def watch_replicas(self, force: bool = False) -> None:
        """At most once a second, four times while a server is out (or now): drop dead servers
        from routing, let restarted ones rejoin with the current weights
        (:meth:`Cluster.watch_replicas`)."""
        now = time.monotonic()
        every = 1.0 if len(self.cluster.live) == self.cluster.n_gen else 0.25
        if not force and now - self._replicas_read_at < every:
            return
        self._replicas_read_at = now
        if self.cluster.watch_replicas(self.master.alive("generation"), self.state.step):
            self.router.set_live(self.cluster.live)
            self.master.set_progress(**{**self.master.progress(), "servers": self.servers()})

    def servers(self) -> str | None:
        """``live/all`` generation servers while some are out, for the progress line."""
        live, n = len(self.cluster.live), self.cluster.n_gen
        return None if live == n else f"{live}/{n}"

    def wait_for_replica(self) -> None:
        """Until at least one generation server is live (a lone server may be restarting)."""
        while not self.cluster.live:
            if self.master.stopping:
                raise RuntimeError("stopped while waiting for a generation server")
            self.watch_replicas(force=True)
            time.sleep(0.25)

    def step(self) -> None:
        """One training step, from taking a batch to the checkpoint."""
        rl, state = self.rl, self.state
        t0 = time.monotonic()
        batch = self.next_batch()
        t_wait = time.monotonic() - t0
        stats = train_step(self.cluster, rl, batch, state)
        state.step += 1
        state.consumed += rl.batch_size
        self.admission.consumed(rl.batch_size)
        sync = self.publish() if (
            state.step % rl.sync_interval == 0 or state.step == rl.total_steps) else {}
        self.admission.set_version(state.step)
        ev = self.evaluate() if self.held_out and (
            (rl.eval_interval and state.step % rl.eval_interval == 0)
            or state.step == rl.total_steps) else None
        acc = None if ev is None else ev.accuracy
        row = {**stats, **sync, "wait_seconds": t_wait, "step_seconds": time.monotonic() - t0,
               "buffered": len(self.buffer), "in_flight": len(self.source.in_flight),
               "dropped_stale": self.buffer.dropped, "samples_per_s": self.samples_per_s(),
               "leases_expired": self.source.expired, "leases_released": self.source.released,
               "prompts_skipped": len(self.source.cursor.skipped),
               "filtered_groups": self.uniform.filtered,
               "rollout_reward": self.uniform.rollout_reward()}
        if ev is not None:
            row.update(ev.figures())
        self.metrics.log(state.step, **row)
        self.master.set_progress(
            step=f"{state.step}/{rl.total_steps}", reward=f"{row['reward']:.3f}",
            samples_s=f"{row['samples_per_s']:.1f}",
            staleness=f"{row['staleness_max']}/{rl.eta}", version=self.published,
            eval=None if acc is None else f"{acc:.3f}", servers=self.servers(),
            filtered=self.uniform.filtered if rl.dynamic_sampling else None,
            # also here (a poll can miss "starting"), and the same: 0 for a start from scratch
            resumed_from=self.resumed_from or 0)
        preempts = self.preempt_requests()
        if preempts or self.checkpoint_due():
            self.checkpoint()
            if state.step > (self.resumed_from or 0) + 1:  # (not the first: it warms up)
                note = self.window.check(self._last_cost or 0.0, row["step_seconds"] - t_wait
                                         + PREEMPT_READ_S)
                if note:
                    log.warning("%s", note)
        if preempts:
            self.hold_for_restart(preempts)
        if rl.crash_at_step and state.step == rl.crash_at_step and self.resumed_from is None:
            raise RuntimeError(f"injected failure after step {state.step} (rl.crash_at_step)")

    def samples_per_s(self) -> float:
        done = self.state.consumed * self.rl.group_size - self.samples_at_start
        return done / max(time.monotonic() - self.t_loop, 1e-9)

    def next_batch(self) -> list[tuple[Admitted, int]]:
        """Read the trajectory stream until B admissible groups are buffered; take them."""
        while True:
            dropped: list[Admitted] = self.buffer.drop_stale(self.state.step)  # type: ignore
            if dropped:
                self.admission.discard(len(dropped))
                self.source.give_back([(int(a.group["prompt_id"]), a.epoch) for a in dropped])
            got = self.buffer.take(self.rl.batch_size, self.state.step)
            if got is not None:
                self.uniform.batch_taken()
                return got  # type: ignore[return-value]
            if self.master.stopping:
                raise RuntimeError("stopped during training")
            self.reclaim_leases()  # each wait below is at most 0.5 s
            self.watch_replicas()
            preempts = self.preempt_requests()
            if preempts:  # between steps: a checkpoint now holds everything trained
                self.checkpoint()
                self.hold_for_restart(preempts)
            msg = self.puller.recv(0.5)
            if msg is None:
                continue
            pid = int(msg["prompt_id"])
            if msg["unservable"]:  # a server refused its request for good: skip the prompt
                self.skip_prompt(int(msg["seq"]), pid, "a generation server refused its "
                                 f"request ({msg['error']})")
                continue
            if msg["agent_error"] and self.source.leased(int(msg["seq"])):
                verdict = self.agent_failures.failed(pid)
                if verdict == "stop":
                    raise ConfigError(
                        f"rl.agent.function={self.rl.agent.function!r} failed on the last "
                        f"{self.agent_failures.limit} groups in a row (none succeeded in "
                        f"between); the last: {msg['error']}")
                if verdict == "skip":
                    self.skip_prompt(int(msg["seq"]), pid, f"its group failed {PROMPT_TRIES} "
                                     f"times in the agent function (the last: {msg['error']})")
                    continue
            uniform = not msg["failed"] and self.uniform.drops(msg)  # (dynamic sampling)
            task = self.source.finish(int(msg["seq"]), not (msg["failed"] or uniform),
                                      redo=not uniform)
            if task is None:
                continue  # a duplicate or a leftover from before a restart
            if msg["failed"]:
                log.warning("rollout of prompt %s failed: %s", msg["prompt_id"], msg["error"])
                continue
            self.agent_failures.accepted(pid)
            self.uniform.arrived(msg, filtered=uniform)
            if uniform:  # (the live line shows it while a batch fills)
                self.master.set_progress(**{**self.master.progress(),
                                            "filtered": self.uniform.filtered})
                continue
            # before it is buffered: a checkpoint (which saves the buffer) never holds it
            check_behaviour_logprobs(msg["trajs"], self.state.step + 1)
            self.buffer.put(Admitted(msg, task["epoch"]),
                            group_version(msg["trajs"], task["version"]), int(msg["seq"]))

    def skip_prompt(self, seq: int, prompt_id: int, why: str) -> None:
        """Task ``seq``'s prompt ``prompt_id`` cannot be served (its request was refused: it
        does not fit ``rl.vllm.max_model_len``, say; or the agent function keeps failing on
        it): it is not handed out again in this run (a resumed run finds it again).
        ConfigError once no training prompt is left."""
        new = prompt_id not in self.source.cursor.skipped  # (two leases may hold it)
        if self.source.skip(seq) is None or not new:
            return
        log.warning("prompt %d of the training set is skipped: %s", prompt_id, why)
        skipped = len(self.source.cursor.skipped)
        if self.source.cursor.exhausted:
            raise ConfigError(f"every training prompt ({skipped}) is skipped; the last: {why}")

    def reclaim_leases(self) -> None:
        """Release the leases that ran out, and those of rollout workers whose heartbeat expired,
        so their prompts go to the live workers (same epoch) and their admission slots reopen:
        without this a lost task would hold its slot for good (with eta = 0, stall the loop)."""
        expired = self.source.expire()
        if expired:
            log.warning("released %d lease(s) older than rl.lease_timeout=%gs: %s",
                        len(expired), self.source.lease_timeout, describe_tasks(expired))
        now = time.monotonic()
        if now - self._heartbeats_read_at < 1.0:  # name resolution is a filesystem: poll gently
            return
        if self.master.names_just_back():  # heartbeats lost with the name service: no news
            return
        self._heartbeats_read_at = now
        holders = self.source.lease_holders()
        if not holders:
            return
        for worker in sorted(holders - self.master.alive("rollout")):
            released = self.source.release_worker(worker)
            if released:
                log.warning("rollout worker %d stopped heart-beating: released its %d lease(s): "
                            "%s", worker, len(released), describe_tasks(released))

    def preempt_requests(self) -> list[str]:
        """Workers warned of preemption (SIGUSR2) that wait for a checkpoint before they stop
        (read at most once a second)."""
        now = time.monotonic()
        if now - self._preempts_read_at < 1.0:
            return []
        self._preempts_read_at = now
        return self.master.preempt_requests()

    def hold_for_restart(self, preempts: list[str]) -> None:
        """Workers that hold training state were warned of preemption and the checkpoint they
        wait for is committed: let them stop, and train no further step (it would be lost)
        until the controller restarts the master and model workers from that checkpoint."""
        log.warning("checkpoint at step %d for the preempted %s: waiting for the restart",
                    self.state.step, ", ".join("/".join(k.split("/")[-2:]) for k in preempts))
        self.master.preempts_checkpointed(preempts)
        while not self.master.wait_stop(0.5):  # nothing trains after this checkpoint, so it
            late = self.master.preempt_requests()  # holds what a later request waits for too
            if late:  # (a worker warned while it was taken: it waited for the next, in vain)
                self.master.preempts_checkpointed(late)
        raise RuntimeError(f"stopped after the preemption checkpoint at step {self.state.step}")

    def resume_point(self) -> int | None:
        """The step of the newest readable checkpoint when resuming (``recover=resume``);
        :class:`~experiments.rl.checkpoint.UnreadableCheckpoints` when none of them reads."""
        if self.master.config["recover"] != "resume":
            return None
        step = self.ckpt.latest()
        if step is None:
            log.info("recover=resume and %s holds no checkpoint: starting at step 0",
                     self.ckpt.root)
            return None
        # (the launcher checked this already; a worker's own view of the files decides)
        check_resume_layout(self.ckpt.root, self.layout)
        return step

    def checkpoint_due(self) -> bool:
        """Every ``save_interval`` steps, once ``save_interval_s`` seconds have passed since the
        last checkpoint (or since the loop started), and as often as keeps checkpointing under
        ``save_overhead`` of the loop's time (the first one after the first step: its cost is
        not known before), whichever comes first; and after the last step, unless all three
        are off (the trained policy is kept: ``mode=eval`` reads it, a rerun finds the trial
        done instead of training its last steps again)."""
        rl = self.rl
        if rl.save_interval and self.state.step % rl.save_interval == 0:
            return True
        if self.state.step >= rl.total_steps and (rl.save_interval or rl.save_interval_s > 0
                                                  or rl.save_overhead > 0):
            return True
        since = time.monotonic() - (self._last_save if self._last_save is not None
                                    else self.t_loop)
        if rl.save_overhead > 0 and (self._last_cost is None
                                     or since >= self._last_cost / rl.save_overhead):
            return True
        return rl.save_interval_s > 0 and since >= rl.save_interval_s

    def checkpoint(self) -> None:
        t0 = time.monotonic()
        state = self.state
        staging = self.ckpt.staging(state.step)
        saved = self.cluster.on_models(lambda c: c.save(staging))
        save_tokenizer(self.tok, os.path.join(staging, "actor"))  # (loads as a model)
        state.cursor = self.source.snapshot()
        state.loop_seconds = self.loop_seconds()
        state.dropped_stale, state.filtered = self.buffer.dropped, self.uniform.filtered
        state.leases_expired, state.leases_released = self.source.expired, self.source.released
        state.issued = self.source.resume_seq()
        state.buffer = self.buffer.items()  # type: ignore[assignment]
        save_state(staging, state)
        self.ckpt.commit(state.step, {"layout": self.layout,
                                      "consumed": state.consumed, "buffered": len(state.buffer),
                                      "cursor": {k: v for k, v in state.cursor.items()
                                                 if k != "redo"}},
                         digests={k: v for r in saved for k, v in r["digests"].items()})
        state.buffer = []
        # the clock restarts after the write: a slow checkpoint must not trigger the next one
        self._last_save = time.monotonic()
        self._last_cost = self._last_save - t0
        log.info("checkpoint at step %d (%.2fs)", state.step, self._last_cost)

    def close(self) -> None:
        self.source.stop()
        self.master.serve_tasks(None)
        self.puller.close()
        self.cluster.close()

    def loop_seconds(self) -> float:
        """Seconds the loop ran, over every master that trained this trial (see
        :attr:`LoopState.loop_seconds`)."""
        return self.seconds_at_start + time.monotonic() - self.t_loop

    def summary(self, t_start: float, loop_seconds: float) -> dict[str, Any]:
        """The run's headline figures (:func:`~experiments.rl.summary.run_summary`)."""
        return run_summary(self.rl, self.state, self.metrics, self.trial_dir,
                           f"{self.master.boot.experiment} ({self.rl.mode}, {self.rl.algorithm})",
                           self.resumed_from, self.window.notes, t_start, loop_seconds)
