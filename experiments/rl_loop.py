"""The master's RL loop. :func:`master_role` reads like a single-process training script; the
distributed work hides behind :class:`Cluster` (calls to model workers and generation servers).

Per step: take B groups from the buffer (admission keeps rollouts within eta versions, the
buffer drops any that still got too old), compute proximal / reference log-probs and advantages,
train, publish weights every ``sync_interval`` steps, evaluate every ``eval_interval`` steps and
checkpoint every ``save_interval`` steps. Sync mode is the same loop with eta = 0: no rollout may
start before the weights it must use are published, so every batch is generated, then trained.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import random
import shutil
import time
from typing import Any

import numpy as np
import torch

from experiments.agents import make_agent
from experiments.algorithms.advantages import gae, grpo_advantages
from experiments.rl import (eval_prompts, group_version, load_tokenizer,
                            model_path, rl_config, run_episodes, score)
from experiments.rl_config import RLConfig
from experiments.rl_data import PromptCursor, Router, TaskSource
from experiments.tasks import dataset, get_task
from system import names
from system.checkpoint import CheckpointDir
from system.metrics import MetricsLog
from system.param_specs import ModelShape
from system.rpc import StreamPuller
from workers.admission import AdmissionConfig, AdmissionController, TrajectoryBuffer
from workers.client import PeerClients
from workers.generation import GenerationClient

log = logging.getLogger("rl-master")


class Cluster:
    """The master's view of the other workers: collective calls on model workers, weight
    updates and evaluation requests on generation servers."""

    def __init__(self, master: Any, rl: RLConfig) -> None:
        self.master, self.rl = master, rl
        self.peers = PeerClients(master.peers, lambda a: master.client(a, rl.call_timeout),
                                 exclude=master.name)
        counts = master.config["counts"]
        self.n_model, self.n_gen = int(counts["model"]), int(counts["generation"])
        self.gens: list[GenerationClient] = []

    def wait_ready(self, timeout: float) -> None:
        """Until every model worker has its engines and every generation server its vLLM."""
        deadline = time.monotonic() + timeout
        while True:
            self.peers.refresh()
            models, gens = self.peers.of_kind("model"), self.peers.of_kind("generation")
            ok_m = [self._try(c.rpc, "ready") for c in models]
            ok_g = [self._try(c.rpc, "engine_stats") for c in gens]
            if (len(models) == self.n_model and len(gens) == self.n_gen and all(ok_m)
                    and all(r is not None for r in ok_g)):
                break
            if self.master.stopping:
                raise RuntimeError("stopped while waiting for engines")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready within {timeout:.0f}s "
                                   f"(model ready: {ok_m}, generation: {ok_g})")
            time.sleep(0.5)
        self.models = models
        self.gens = [GenerationClient(c.rpc, c.name) for c in gens]

    @staticmethod
    def _try(rpc: Any, method: str) -> Any:
        try:
            return rpc.call(method, 5.0)
        except Exception:
            return None

    # --- collective calls on every model worker ---
    def on_models(self, method: str, per_rank: list[dict[str, Any]] | None = None,
                  **common: Any) -> list[Any]:
        ids = [c.rpc.submit(method, **common, **(per_rank[i] if per_rank else {}))
               for i, c in enumerate(self.models)]
        return [c.rpc.result(rid, self.rl.call_timeout) for c, rid in zip(self.models, ids)]

    def split(self, items: list[Any]) -> list[list[int]]:
        """Indices per data-parallel rank, balanced by length (longest first, greedy)."""
        loads = [0] * self.n_model
        parts: list[list[int]] = [[] for _ in range(self.n_model)]
        for i in sorted(range(len(items)), key=lambda i: -len(items[i]["tokens"])):
            r = loads.index(min(loads))
            parts[r].append(i)
            loads[r] += len(items[i]["tokens"])
        return parts

    def per_token(self, method: str, seqs: list[np.ndarray], **kw: Any) -> list[np.ndarray]:
        """log-probs / values of every sequence, data-parallel."""
        parts = self.split([{"tokens": s} for s in seqs])
        outs = self.on_models(method, [{"seqs": [seqs[i] for i in p]} for p in parts], **kw)
        res: list[Any] = [None] * len(seqs)
        for p, o in zip(parts, outs):
            for i, v in zip(p, o):
                res[i] = v
        return res

    def train(self, method: str, batch: list[dict], **kw: Any) -> dict[str, float]:
        parts = self.split(batch)
        global_tokens = int(sum(int(b["mask"].sum()) for b in batch))
        outs = self.on_models(method, [{"batch": [batch[i] for i in p]} for p in parts],
                              global_tokens=global_tokens, **kw)
        stats: dict[str, float] = {}
        for o in outs:
            for k, v in o.items():
                stats[k] = stats.get(k, 0.0) + float(v)
        # each rank's loss is already its share of the global token mean, so the sum is the
        # loss; the others are per-rank figures, averaged
        for k in ("grad_norm", "seconds"):
            if k in stats:
                stats[k] /= len(outs)
        return stats

    # --- weights ---
    def init_weight_sync(self, path: str, engine_info: dict[str, Any]) -> None:
        from transformers import AutoConfig

        ws = self.rl.weight_sync
        if ws.mode == "disk":
            return
        spec = {"src": {"dp": self.n_model, "tp": 1, "pp": 1},
                "dst": {"tp": self.rl.vllm.tensor_parallel_size, "replicas": self.n_gen},
                "shape": dataclasses.asdict(ModelShape.from_hf(AutoConfig.from_pretrained(path))),
                "dtype": engine_info["dtype"], "backend": engine_info["backend"],
                "mode": ws.mode, "bucket_bytes": ws.bucket_mb << 20, "timeout": ws.timeout}
        ids_m = [c.rpc.submit("weight_sync_init", spec=spec) for c in self.models]
        ids_g = [g.rpc.submit("weight_sync_init", spec=spec) for g in self.gens]
        for c, rid in zip(self.models, ids_m):
            c.rpc.result(rid, ws.timeout + 30)
        for g, rid in zip(self.gens, ids_g):
            g.rpc.result(rid, ws.timeout + 30)

    def publish(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.rl.weight_sync.mode == "disk":
            directory = os.path.join(self.master.boot.trial_dir, "weights", f"v{version}")
            self.on_models("save_weights", directory=directory)
            ids = [g.rpc.submit("load_weights_from_disk", directory=directory, version=version)
                   for g in self.gens]
            for g, rid in zip(self.gens, ids):
                g.rpc.result(rid, self.rl.call_timeout)
            old = os.path.join(self.master.boot.trial_dir, "weights", f"v{version - 1}")
            shutil.rmtree(old, ignore_errors=True)
            return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": 0.0}
        ids_g = [g.rpc.submit("update_weights", version=version) for g in self.gens]
        sent = self.on_models("send_weights")
        for g, rid in zip(self.gens, ids_g):
            g.rpc.result(rid, self.rl.call_timeout)
        return {"sync_seconds": time.perf_counter() - t0,
                "sync_bytes": float(sum(s["bytes_sent"] for s in sent))}

    def close(self) -> None:
        self.peers.close()


@dataclasses.dataclass
class LoopState:
    """What a checkpoint restores on the master."""

    step: int = 0
    consumed: int = 0                     # groups trained on
    cursor: dict[str, Any] | None = None
    buffer: list[tuple[dict, int]] = dataclasses.field(default_factory=list)
    history: list[list[list[int]]] = dataclasses.field(default_factory=list)
    """[prompt id, epoch] of every group trained on, per step."""
    max_staleness: int = 0
    eval_before: float | None = None
    rng: Any = None


def advantages_grpo(trajs: list[dict], n: int) -> list[np.ndarray]:
    rewards = torch.tensor([t["reward"] for t in trajs])
    adv = grpo_advantages(rewards, n)
    return [np.full(len(t["mask"]), float(a), np.float32) for t, a in zip(trajs, adv)]


def advantages_ppo(trajs: list[dict], values: list[np.ndarray], rl: RLConfig
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token rewards (the score on the last policy token, minus the KL penalty folded into the
    loss), GAE over policy tokens, whitened advantages; returns (advantages, returns)."""
    t_max = max(len(t["mask"]) for t in trajs)
    r = torch.zeros(len(trajs), t_max)
    v = torch.zeros(len(trajs), t_max)
    m = torch.zeros(len(trajs), t_max)
    for i, t in enumerate(trajs):
        k = len(t["mask"])
        m[i, :k] = torch.as_tensor(t["mask"], dtype=torch.float32)
        v[i, :k] = torch.as_tensor(values[i][t["prompt_len"] - 1:], dtype=torch.float32)
        pol = np.nonzero(t["mask"])[0]
        if len(pol):
            r[i, pol[-1]] = t["reward"]
    adv, ret = gae(r, v, m, rl.gamma, rl.lam)
    sel = adv[m > 0]
    if sel.numel() > 1:
        adv = (adv - sel.mean()) / (sel.std() + 1e-6) * m
    return ([adv[i, :len(t["mask"])].numpy() for i, t in enumerate(trajs)],
            [ret[i, :len(t["mask"])].numpy() for i, t in enumerate(trajs)])


def evaluate(cluster: Cluster, rl: RLConfig, tok: Any, agent: Any, router: Router,
             prompts: list[tuple[dict, list[int]]]) -> float:
    """Greedy accuracy on the held-out prompts (rewards in [0, 1])."""
    if not prompts:
        return float("nan")
    task = get_task(rl.task)
    episodes = []
    for _, ids in prompts:
        server = router.pick()
        episodes += [(ep, server) for ep in agent.episodes(ids, 1, greedy=True)]
    clients = {i: g for i, g in enumerate(cluster.gens)}
    try:
        results = run_episodes(episodes, clients, rl.call_timeout)
    finally:
        for _, server in episodes:
            router.done(server)
    total = 0.0
    for (p, _), trajs in zip(prompts, results):
        score(trajs, tok, p["answer"], task.reward)
        total += trajs[0]["reward"]
    return total / len(prompts)


def master_role(master: Any) -> dict[str, Any]:
    rl = rl_config(master)
    path = model_path(master, rl)
    tok = load_tokenizer(path)
    trial_dir = master.boot.trial_dir
    resume = master.config.get("recover") == "resume"
    ckpt = CheckpointDir(os.path.join(trial_dir, "checkpoints"), rl.keep_checkpoints)
    state = LoopState()
    latest = ckpt.latest() if resume else None
    if latest is not None:
        with open(os.path.join(ckpt.path(latest), "master.pkl"), "rb") as f:
            state = pickle.load(f)
    random.seed(rl.seed)
    np.random.seed(rl.seed)
    if state.rng is not None:
        random.setstate(state.rng["python"])
        np.random.set_state(state.rng["numpy"])
    metrics = MetricsLog(trial_dir, resume=latest is not None)
    metrics.truncate(state.step)

    eta = rl.eta
    admission = AdmissionController(AdmissionConfig(rl.batch_size, eta))
    buffer = TrajectoryBuffer(eta)
    for item, version in state.buffer:
        buffer.put(item, version)
    admission.restore(state.step, state.consumed, len(state.buffer))
    cursor = PromptCursor([p["id"] for p in dataset(rl.task, "train")], rl.seed)
    if state.cursor:
        cursor.restore(state.cursor)
    cluster = Cluster(master, rl)
    router = Router(cluster.n_gen)
    source = TaskSource(admission, cursor, router, rl.group_size)
    puller = StreamPuller(master.codec, master.host, master.rpc_cfg.stream_hwm)
    master.name_resolve.add(names.stream(master.exp, master.trial, "trajectories"),
                            puller.address, replace=True)
    agent = make_agent(rl.agent, tok)
    held_out = eval_prompts(rl, tok)
    t_start = time.monotonic()
    master.set_progress(phase="loading engines")
    try:
        cluster.wait_ready(rl.startup_timeout)
        info = cluster.on_models("engine_info")[0]
        cluster.init_weight_sync(path, info)
        if state.step > 0:  # the servers loaded the base model: give them the checkpoint's
            cluster.publish(state.step)
        if state.eval_before is None:
            master.set_progress(phase="evaluating")
            state.eval_before = evaluate(cluster, rl, tok, agent, router, held_out)
            metrics.log(0, eval_accuracy=state.eval_before)
        t_loop = time.monotonic()
        master.task_source = source  # rollouts begin
        samples_at_start = state.consumed * rl.group_size
        while state.step < rl.total_steps:
            t0 = time.monotonic()
            batch = _next_batch(master, puller, source, admission, buffer, rl, state)
            t_wait = time.monotonic() - t0
            step_stats = _train(cluster, rl, batch, state)
            state.step += 1
            state.consumed += rl.batch_size
            admission.consumed(rl.batch_size)
            sync = {}
            if state.step % rl.sync_interval == 0 or state.step == rl.total_steps:
                sync = cluster.publish(state.step)
            admission.set_version(state.step)
            acc = None
            if (rl.eval_interval and state.step % rl.eval_interval == 0) \
                    or state.step == rl.total_steps:
                acc = evaluate(cluster, rl, tok, agent, router, held_out)
            elapsed = time.monotonic() - t_loop
            row = {**step_stats, **sync, "wait_seconds": t_wait,
                   "step_seconds": time.monotonic() - t0, "buffered": len(buffer),
                   "in_flight": len(source.in_flight), "dropped_stale": buffer.dropped,
                   "samples_per_s": (state.consumed * rl.group_size - samples_at_start)
                   / max(elapsed, 1e-9)}
            if acc is not None:
                row["eval_accuracy"] = acc
            metrics.log(state.step, **row)
            master.set_progress(step=f"{state.step}/{rl.total_steps}",
                                reward=f"{row['reward']:.3f}",
                                samples_s=f"{row['samples_per_s']:.1f}",
                                staleness=f"{row['staleness_max']}/{eta}",
                                version=state.step,
                                eval=None if acc is None else f"{acc:.3f}")
            if rl.save_interval and state.step % rl.save_interval == 0:
                _checkpoint(cluster, ckpt, state, buffer, source)
            if rl.crash_at_step and state.step == rl.crash_at_step and latest is None:
                raise RuntimeError(f"injected failure after step {state.step} "
                                   "(rl.crash_at_step)")
        source.stop()
        eval_after = metrics.series("eval_accuracy")[-1][1]
        loop_seconds = time.monotonic() - t_loop
    finally:
        source.stop()
        master.task_source = None
        puller.close()
        cluster.close()
    rewards = [r for _, r in metrics.series("reward")]
    plot = metrics.plot(os.path.join(trial_dir, "reward.png"),
                        f"{master.boot.experiment} ({rl.mode}, {rl.algorithm})")
    metrics.close()
    first3 = float(np.mean(rewards[:3])) if rewards else float("nan")
    last3 = float(np.mean(rewards[-3:])) if rewards else float("nan")
    summary = {"reward_first3": first3, "reward_last3": last3,
               "reward_gain": last3 - first3, "eval_accuracy_before": state.eval_before,
               "eval_accuracy_after": eval_after, "mode": rl.mode, "algorithm": rl.algorithm,
               "max_staleness_used": state.max_staleness, "max_head_offpolicyness": eta,
               "steps": state.step, "resumed_from_step": latest,
               "samples_per_s": (state.consumed * rl.group_size - samples_at_start)
               / max(loop_seconds, 1e-9),
               "loop_seconds": loop_seconds, "total_seconds": time.monotonic() - t_start,
               "plot": plot, "tensorboard": os.path.join(trial_dir, "tensorboard")}
    return {"summary": summary, "prompts_per_step": state.history,
            "dropped_stale": buffer.dropped}


def _next_batch(master: Any, puller: StreamPuller, source: TaskSource,
                admission: AdmissionController, buffer: TrajectoryBuffer, rl: RLConfig,
                state: LoopState) -> list[tuple[dict, int]]:
    """Read the trajectory stream until B admissible groups are buffered; take them."""
    while True:
        dropped = buffer.drop_stale(state.step)
        if dropped:
            admission.discard(len(dropped))
            source.give_back([(int(g["prompt_id"]), int(g["epoch"])) for g in dropped])
        got = buffer.take(rl.batch_size, state.step)
        if got is not None:
            return got
        if master.stopping:
            raise RuntimeError("stopped during training")
        msg = puller.recv(0.5)
        if msg is None:
            continue
        task = source.finish(int(msg["seq"]), accepted=not msg["failed"])
        if task is None:
            continue  # a duplicate or a leftover from before a restart
        if msg["failed"]:
            log.warning("rollout of prompt %s failed: %s", msg["prompt_id"], msg["error"])
            continue
        msg["epoch"] = task["epoch"]
        buffer.put(msg, group_version(msg["trajs"], task["version"]))


def _train(cluster: Cluster, rl: RLConfig, batch: list[tuple[dict, int]], state: LoopState
           ) -> dict[str, Any]:
    groups = [g for g, _ in batch]
    staleness = [state.step - v for _, v in batch]
    state.max_staleness = max([state.max_staleness, *staleness])
    state.history.append([[int(g["prompt_id"]), int(g["epoch"])] for g in groups])
    trajs = [t for g in groups for t in g["trajs"]]
    seqs = [t["tokens"] for t in trajs]
    items = [{"tokens": t["tokens"], "prompt_len": int(t["prompt_len"]),
              "mask": t["mask"].astype(np.float32), "old_logp": t["logprobs"]} for t in trajs]
    need_prox = rl.mode == "async" and rl.decoupled_loss
    if need_prox:
        prox = cluster.per_token("logprobs", seqs, which="actor")
        for it, lp in zip(items, prox):
            it["prox_logp"] = lp[it["prompt_len"] - 1:]
    if rl.loss.kl_coef > 0:
        ref = cluster.per_token("logprobs", seqs, which="ref")
        for it, lp in zip(items, ref):
            it["ref_logp"] = lp[it["prompt_len"] - 1:]
    stats: dict[str, Any] = {}
    if rl.algorithm == "grpo":
        advs = advantages_grpo(trajs, rl.group_size)
    else:
        values = cluster.per_token("values", seqs)
        advs, returns = advantages_ppo(trajs, values, rl)
        for it, v, r in zip(items, values, returns):
            it["old_values"] = v[it["prompt_len"] - 1:]
            it["returns"] = r
        critic = cluster.train("train_critic", items, value_clip=rl.value_clip)
        stats["value_loss"] = critic.get("value_loss_sum", 0.0) / max(critic.get("tokens", 1), 1)
    for it, a in zip(items, advs):
        it["adv"] = a
    out = cluster.train("train_actor", items, loss=dataclasses.asdict(rl.loss))
    tokens = max(out.get("tokens", 1.0), 1.0)
    gen_tokens = int(sum(int(t["mask"].sum()) for t in trajs))
    stats.update({
        "reward": float(np.mean([t["reward"] for t in trajs])),
        "loss": out["loss"], "grad_norm": out["grad_norm"],
        "clip_fraction": out.get("clip_fraction_sum", 0.0) / tokens,
        "behav_weight_mean": out.get("behav_weight_mean_sum", 0.0) / tokens,
        "kl": out.get("kl_sum", 0.0) / tokens if rl.loss.kl_coef > 0 else None,
        "train_seconds": out.get("seconds", 0.0),
        "train_tokens_per_s": out.get("train_tokens", 0.0) / max(out.get("seconds", 1e-9), 1e-9),
        "gen_tokens": gen_tokens,
        "completion_len": gen_tokens / max(len(trajs), 1),
        "staleness_max": max(staleness), "staleness_mean": float(np.mean(staleness)),
        "versions": sorted({int(v) for t in trajs for v in t["versions"] if v >= 0}),
        "cut_samples": sum(len({int(v) for v in t["versions"] if v >= 0}) > 1 for t in trajs),
    })
    return stats


def _checkpoint(cluster: Cluster, ckpt: CheckpointDir, state: LoopState,
                buffer: TrajectoryBuffer, source: TaskSource) -> None:
    staging = ckpt.staging(state.step)
    cluster.on_models("save", directory=staging)
    state.cursor = source.snapshot()
    state.buffer = buffer.items()
    state.rng = {"python": random.getstate(), "numpy": np.random.get_state()}
    with open(os.path.join(staging, "master.pkl"), "wb") as f:
        pickle.dump(state, f)
    ckpt.commit(state.step, {"consumed": state.consumed, "buffered": len(state.buffer),
                             "cursor": {k: v for k, v in state.cursor.items() if k != "redo"}})
    state.buffer = []
    log.info("checkpoint at step %d", state.step)

