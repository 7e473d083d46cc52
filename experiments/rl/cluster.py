"""The master's view of the other workers: data-parallel calls on every model worker, weight
updates and evaluation requests on generation servers."""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from experiments.rl.config import RLConfig
from system.reshard.layout import GenLayout, TrainLayout
from system.reshard.params import ModelShape
from system.reshard.spec import WeightSyncSpec
from workers.client import Pending, collect
from workers.generation import GenerationClient
from workers.master import MasterWorker
from workers.model import ModelClient
from workers.peers import PeerClients
from workers.schema import EngineInfo, TrainItem, TrainStats

T = TypeVar("T")


class Cluster:
    def __init__(self, master: MasterWorker, rl: RLConfig) -> None:
        self.master, self.rl = master, rl
        self.peers = PeerClients(master.peers, lambda a: master.client(a, rl.call_timeout),
                                 exclude=master.name)
        counts = master.config["counts"]
        self.n_model, self.n_gen = int(counts["model"]), int(counts["generation"])
        self.models: list[ModelClient] = []
        self.gens: list[GenerationClient] = []

    def wait_ready(self, timeout: float) -> None:
        """Until every model worker has its engines and every generation server its vLLM."""
        deadline = time.monotonic() + timeout
        while True:
            self.peers.refresh()
            models, gens = self.peers.models(), self.peers.generation_servers()
            ok_m = [_answer(c.ready()) for c in models]
            ok_g = [_answer(g.engine_stats()) for g in gens]
            if (len(models) == self.n_model and len(gens) == self.n_gen and all(ok_m)
                    and all(r is not None for r in ok_g)):
                break
            if self.master.stopping:
                raise RuntimeError("stopped while waiting for engines")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready within {timeout:.0f}s "
                                   f"(model ready: {ok_m}, generation: {ok_g})")
            time.sleep(0.5)
        self.models, self.gens = models, gens

    # --- data-parallel calls on every model worker ---
    def on_models(self, call: Callable[[ModelClient], Pending[T]]) -> list[T]:
        """``call`` on every model worker at once (a collective: every rank gets it)."""
        return collect([call(c) for c in self.models], self.rl.call_timeout)

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices per data-parallel rank, balanced by length (longest first, greedy)."""
        loads = [0] * self.n_model
        parts: list[list[int]] = [[] for _ in range(self.n_model)]
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            r = loads.index(min(loads))
            parts[r].append(i)
            loads[r] += lengths[i]
        return parts

    def per_token(self, seqs: list[np.ndarray], which: str) -> list[np.ndarray]:
        """Per-token log-probs (``actor``, ``ref``) or values (``critic``) of every sequence,
        data-parallel."""
        parts = self.split([len(s) for s in seqs])
        calls = [(lambda c, p=p: c.values([seqs[i] for i in p])) if which == "critic"
                 else (lambda c, p=p: c.logprobs([seqs[i] for i in p], which)) for p in parts]
        outs = collect([call(c) for call, c in zip(calls, self.models)], self.rl.call_timeout)
        res: list[Any] = [None] * len(seqs)
        for p, o in zip(parts, outs):
            for i, v in zip(p, o):
                res[i] = v
        return res

    def train(self, batch: list[TrainItem], critic: bool = False) -> TrainStats:
        """One train step of the actor (or the critic) on ``batch``, split over the ranks."""
        parts = self.split([len(b["tokens"]) for b in batch])
        global_tokens = int(sum(int(b["mask"].sum()) for b in batch))
        loss = dataclasses.asdict(self.rl.loss)
        pending = [c.train_critic([batch[i] for i in p], global_tokens, self.rl.value_clip)
                   if critic else c.train_actor([batch[i] for i in p], global_tokens, loss)
                   for c, p in zip(self.models, parts)]
        return sum_stats(collect(pending, self.rl.call_timeout))

    # --- weights ---
    def init_weight_sync(self, path: str, info: EngineInfo) -> None:
        from transformers import AutoConfig

        ws = self.rl.weight_sync
        if ws.mode == "disk":
            return
        spec = WeightSyncSpec(src=TrainLayout(dp=self.n_model),
                              dst=GenLayout(tp=self.rl.vllm.tensor_parallel_size,
                                            replicas=self.n_gen),
                              shape=ModelShape.from_hf(AutoConfig.from_pretrained(path)),
                              dtype=info["dtype"], backend=info["backend"], mode=ws.mode,
                              bucket_bytes=ws.bucket_mb << 20, timeout=ws.timeout)
        pending: list[Pending[Any]] = [c.weight_sync_init(spec) for c in self.models]
        pending += [g.weight_sync_init(spec) for g in self.gens]
        collect(pending, ws.timeout + 30)

    def publish(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.rl.weight_sync.mode == "disk":
            weights = os.path.join(self.master.boot.trial_dir, "weights")
            directory = os.path.join(weights, f"v{version}")
            self.on_models(lambda c: c.save_weights(directory))
            collect([g.load_weights_from_disk(directory, version) for g in self.gens],
                    self.rl.call_timeout)
            shutil.rmtree(os.path.join(weights, f"v{version - 1}"), ignore_errors=True)
            return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": 0.0}
        receiving = [g.update_weights(version) for g in self.gens]
        sent = self.on_models(lambda c: c.send_weights())
        collect(receiving, self.rl.call_timeout)
        return {"sync_seconds": time.perf_counter() - t0,
                "sync_bytes": float(sum(s["bytes_sent"] for s in sent))}

    def close(self) -> None:
        self.peers.close()


def sum_stats(outs: list[TrainStats]) -> TrainStats:
    """Each rank's loss is already its share of the global token mean, so the sum is the loss;
    ``*_sum`` figures and ``tokens`` add up; the per-rank figures are averaged."""
    stats: dict[str, float] = {}
    for o in outs:
        for k, v in o.items():
            stats[k] = stats.get(k, 0.0) + float(v)  # type: ignore[arg-type]
    for k in ("grad_norm", "seconds"):
        if k in stats:
            stats[k] /= len(outs)
    return stats  # type: ignore[return-value]


def _answer(pending: Pending[T]) -> T | None:
    try:
        return pending.result(5.0)
    except Exception:
        return None
