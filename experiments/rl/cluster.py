"""The master's view of the other workers: data-parallel calls on every model worker, weight
updates and evaluation requests on generation servers.

Generation servers come and go while training goes on: each server (replica) has a weight-update
group of its own, so a server that dies leaves the others' updates alone. :attr:`Cluster.live`
is the set of replicas that take part in routing and weight updates; a server that stops
heart-beating or fails an update leaves it, and one that registers again (restarted by the
controller, or requeued by Slurm) joins a fresh group and receives the current weights before it
rejoins (:meth:`Cluster.watch_replicas`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
import uuid
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from experiments.rl.config import RLConfig
from system.reshard.backend import CPU, RankDevice, choose_backend
from system.reshard.hf import weight_names
from system.reshard.layout import GenLayout, TrainLayout
from system.reshard.params import ModelShape, check_mapped
from system.reshard.spec import WeightSyncSpec
from system.errors import RpcError
from workers.client import Pending, collect, collect_settled
from workers.engines.configs import TorchEngineConfig
from workers.generation import GenerationClient
from workers.master import MasterWorker
from workers.model_client import ModelClient
from workers.peers import PeerClients
from workers.schema import EngineInfo, TrainItem, TrainStats

T = TypeVar("T")
log = logging.getLogger("rl-master")


class Cluster:
    def __init__(self, master: MasterWorker, rl: RLConfig) -> None:
        self.master, self.rl = master, rl
        self.peers = PeerClients(master.peers, lambda a: master.client(a, rl.call_timeout),
                                 exclude=master.name)
        counts = master.config["counts"]
        self.n_model, self.n_gen = int(counts["model"]), int(counts["generation"])
        self.models: list[ModelClient] = []
        self.gens: dict[int, GenerationClient] = {}
        """The latest client of every generation server, by replica index."""
        self.live: set[int] = set()
        """Replicas in routing and weight updates."""
        self._joined: dict[int, str] = {}  # replica -> the address it joined weight sync from
        self._left: dict[int, str] = {}  # replica -> the address it left from (not back there)
        self._spec: WeightSyncSpec | None = None
        self._model_devices: list[str] = []  # by rank: each model worker's physical device
        self._gen_devices: dict[int, list[str]] = {}  # replica -> its vLLM workers' (by tp)
        self.layout = train_layout(rl.actor, self.n_model)
        """Model worker ``i`` is training rank ``i`` of this layout."""
        self.leads = [self.layout.rank(dp=d, tp=0, pp=self.layout.pp - 1)
                      for d in range(self.layout.dp)]
        """The rank whose results stand for each data-parallel rank (its last pipeline stage,
        tp rank 0): the other ranks of its model-parallel group were given the same data."""

    def wait_ready(self, timeout: float) -> None:
        """Until every model worker has its engines and every generation server its vLLM."""
        deadline = time.monotonic() + timeout
        while True:
            self.peers.refresh()
            models, gens = self.peers.models(), self.peers.generation_servers()
            # (asked together, answered within 5 s in all: a stop meanwhile is seen at once)
            answers = collect_settled([*[c.ready() for c in models],
                                       *[g.engine_stats() for g in gens]], 5.0, self._stopping)
            answers = [None if isinstance(a, RpcError) else a for a in answers]
            ok_m, ok_g = answers[:len(models)], answers[len(models):]
            if (len(models) == self.n_model and len(gens) == self.n_gen and all(ok_m)
                    and all(r is not None for r in ok_g)):
                break
            if self.master.stopping:
                raise RuntimeError("stopped while waiting for engines")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready within {timeout:.0f}s "
                                   f"(model ready: {ok_m}, generation: {ok_g})")
            time.sleep(0.5)
        self.models = sorted(models, key=lambda c: _index(c.name))  # by rank
        self.gens = {_index(g.name): g for g in gens}
        for g, stats in zip(gens, ok_g):
            if stats is not None:
                self._gen_devices[_index(g.name)] = list(stats.get("devices", []))

    def _stopping(self) -> bool:
        """The master was asked to stop: no reply is waited for any more (a peer stopped at
        the same time may never read the request)."""
        return self.master.stopping

    # --- data-parallel calls on every model worker ---
    def on_models(self, call: Callable[[ModelClient], Pending[T]]) -> list[T]:
        """``call`` on every model worker at once (a collective: every rank gets it)."""
        return collect([call(c) for c in self.models], self.rl.call_timeout, self._stopping)

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices per data-parallel rank, balanced by length (longest first, greedy)."""
        loads = [0] * self.layout.dp
        parts: list[list[int]] = [[] for _ in range(self.layout.dp)]
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            r = loads.index(min(loads))
            parts[r].append(i)
            loads[r] += lengths[i]
        return parts

    def per_token(self, seqs: list[np.ndarray], which: str,
                  temps: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Per-token log-probs (``actor``, ``ref``: at the sampling temperatures ``temps`` of
        each sequence's completion, see :meth:`ModelClient.logprobs`) or values (``critic``) of
        every sequence, data-parallel."""
        parts = self.split([len(s) for s in seqs])
        calls = [(lambda c, p=p: c.values([seqs[i] for i in p])) if which == "critic"
                 else (lambda c, p=p: c.logprobs([seqs[i] for i in p], which,
                                                 None if temps is None
                                                 else [temps[i] for i in p]))
                 for p in parts]
        outs = collect([calls[self.dp_rank(r)](c) for r, c in enumerate(self.models)],
                       self.rl.call_timeout, self._stopping)
        res: list[Any] = [None] * len(seqs)
        for p, lead in zip(parts, self.leads):
            for i, v in zip(p, outs[lead]):
                res[i] = v
        return res

    def train(self, batch: list[TrainItem], critic: bool = False) -> TrainStats:
        """One train step of the actor (or the critic) on ``batch``, split over the ranks."""
        parts = self.split([len(b["tokens"]) for b in batch])
        global_tokens = int(sum(int(b["mask"].sum()) for b in batch))
        loss = dataclasses.asdict(self.rl.loss)
        if not self.rl.decoupled:
            loss["proximal"] = "off"  # standard PPO against the behaviour log-probs
        mine = [[batch[i] for i in parts[self.dp_rank(r)]] for r in range(len(self.models))]
        pending = [c.train_critic(b, global_tokens, self.rl.value_clip)
                   if critic else c.train_actor(b, global_tokens, loss)
                   for c, b in zip(self.models, mine)]
        outs = collect(pending, self.rl.call_timeout, self._stopping)
        return sum_stats([outs[lead] for lead in self.leads])

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of model worker ``rank`` (whose part of a batch it gets)."""
        return self.layout.coord(rank).dp

    # --- weights ---
    def init_weight_sync(self, path: str, infos: list[EngineInfo]) -> None:
        """Plan the per-replica weight update and let every server join (each its own group).
        Refuses (one line naming it) a model with a weight the specs do not map: it would stay
        stale in the generation servers. Model workers with FSDP2 shards send them as they are.
        ``infos``: every model worker's, by rank (their devices pick each group's backend)."""
        ws = self.rl.weight_sync
        info = infos[0]
        self._model_devices = [i["device"] for i in infos]
        if ws.mode != "disk":
            self._spec = WeightSyncSpec(
                src=(dataclasses.replace(self.layout, fsdp=True) if info["sharded"]
                     else self.layout),
                dst=GenLayout(tp=self.rl.vllm.tensor_parallel_size, replicas=1),
                shape=ModelShape.from_dict(info["shape"]),
                dtype=info["dtype"], backend="gloo", mode=ws.mode,  # per replica: join()
                bucket_bytes=ws.bucket_mb << 20, timeout=ws.timeout)
            check_mapped(self._spec.specs(), weight_names(path), f"model {path}")
        self.live = self.join(sorted(self.gens))
        if not self.live:
            raise RuntimeError("no generation server could join the weight updates")

    def join(self, replicas: list[int]) -> set[int]:
        """``replicas`` join fresh weight-update groups (a collective with every model
        worker); returns those that joined."""
        for r in replicas:
            self._joined[r] = self.peers.address(self.gens[r].name) or ""
        if self._spec is None:  # disk mode: nothing to join
            return set(replicas)
        pending: dict[int, list[Pending[Any]]] = {}
        refused = set()
        for r in replicas:
            try:
                spec = self.replica_spec(r)
            except ValueError as e:  # it misreports its devices: left out, the others go on
                log.warning("generation server %d cannot join the weight updates: %s", r, e)
                refused.add(r)
                continue
            group = f"weight_sync/{r}-{uuid.uuid4().hex[:8]}"  # never an old group's store
            pending[r] = [*[c.weight_sync_init(spec, group, r) for c in self.models],
                          self.gens[r].weight_sync_init(spec, group)]
        # each model worker forms the groups one after another: each replica's calls get the
        # timeout from when the one before it is done, not one deadline for them all
        failed = {r for r, calls in pending.items()
                  if any(isinstance(res, RpcError) for res in collect_settled(
                      calls, self._spec.timeout + 30, self._stopping))}
        for r in sorted(failed):
            log.warning("generation server %d could not join the weight updates", r)
        return set(replicas) - failed - refused

    def replica_spec(self, replica: int) -> WeightSyncSpec:
        """The weight-sync spec of ``replica``'s group, with the backend its ranks' devices
        allow (:func:`~system.reshard.backend.choose_backend`: NCCL unless a rank is on the
        CPU or two share a GPU); a fallback to gloo is logged in one line."""
        assert self._spec is not None  # set by init_weight_sync (not in disk mode)
        choice = choose_backend(group_ranks(self._model_devices,
                                            self._gen_devices.get(replica, []), replica,
                                            self._spec.dst.tp))
        if choice.fallback:
            log.warning("%s", choice.line(f"weight sync with generation server {replica}"))
        return dataclasses.replace(self._spec, backend=choice.backend)

    def publish(self, version: int, replicas: set[int] | None = None,
                alive: Callable[[int], bool] | None = None) -> dict[str, float]:
        """Send the actor's current weights to ``replicas`` (default: every live one) as
        ``version``. A server whose update fails leaves :attr:`live` (it rejoins once it
        registers again); ``alive(replica)`` lets a wait on a dead server end early."""
        t0 = time.perf_counter()
        targets = sorted(self.live if replicas is None else replicas)
        if not targets:  # every server is down: they get the weights when they rejoin
            return {"sync_seconds": 0.0, "sync_bytes": 0.0, "sync_replicas": 0.0}
        sent_bytes, failed = 0, {}
        if self.rl.weight_sync.mode == "disk":
            weights = os.path.join(self.master.boot.trial_dir, "weights")
            directory = os.path.join(weights, f"v{version}")
            self.on_models(lambda c: c.save_weights(directory))
            loading = [self.gens[r].load_weights_from_disk(directory, version) for r in targets]
            for r, res in zip(targets, collect_settled(loading, self.rl.call_timeout,
                                                               self._stopping)):
                if isinstance(res, RpcError):
                    failed[r] = str(res)
            _prune(weights, keep=f"v{version}")  # (a resumed run's too)
        else:
            receiving = {r: self.gens[r].update_weights(version) for r in targets}
            for s in self.on_models(lambda c: c.send_weights(targets)):
                sent_bytes += int(s["bytes_sent"])
                failed.update({int(r): why for r, why in s["failed"].items()})
            for r, p in receiving.items():
                if r in failed:
                    continue  # its sender gave up on it: do not wait for its answer
                try:
                    p.result_while(lambda r=r: (alive is None or alive(r))
                                   and not self._stopping(), self.rl.call_timeout)
                except RpcError as e:
                    failed[r] = str(e)
        for r, why in sorted(failed.items()):
            self.drop(r, f"weight update failed: {why}")
        return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": float(sent_bytes),
                "sync_replicas": float(len(targets) - len(failed))}

    def serving(self, replica: int) -> bool:
        """Whether server ``replica`` heart-beats and is still the process the master talks to
        (a restarted one registers at a new address: a call to the old one never returns)."""
        address = self.master.serving_at("generation", replica)
        return address is not None and replica in self.gens and \
            self.gens[replica].rpc.address == address

    def drop(self, replica: int, why: str) -> None:
        """``replica`` leaves routing and weight updates until it registers again."""
        if replica in self.live:
            log.warning("generation server %d left routing and weight updates: %s", replica, why)
            self.live.discard(replica)
        self._left[replica] = self._joined.pop(replica, self._left.get(replica, ""))

    def watch_replicas(self, alive: set[int], version: int) -> bool:
        """Drop the live servers whose heartbeat expired; let servers that registered again
        (a new address) and whose engine is ready join and receive the current weights as
        ``version``. Returns whether :attr:`live` changed."""
        before = set(self.live)
        # heartbeats lost with the name service (a restarted Redis) are no news for a while
        for r in [] if self.master.names_just_back() else sorted(self.live - alive):
            self.drop(r, "it stopped heart-beating")
        self.peers.refresh()
        for g in self.peers.generation_servers():
            r = _index(g.name)
            address = self.peers.address(g.name)
            if r not in alive or address == self._joined.get(r):
                continue
            # the address it left from is most likely a dead process whose keys are not yet
            # cleared: a short wait for it (a live server answers at once)
            wait = 0.25 if address == self._left.get(r) else 2.0
            self.drop(r, "it registered again")
            self.gens[r] = g
            stats = _answer(g.engine_stats(), wait)
            if stats is None:
                continue  # its engine is still starting (or it is gone)
            self._gen_devices[r] = list(stats.get("devices", []))  # it may have moved
            if self.join([r]):
                self.live.add(r)
                self.publish(version, {r}, lambda i: i in alive)
                if r in self.live:
                    log.info("generation server %d rejoined with weights version %d", r,
                             version)
        return self.live != before

    def close(self) -> None:
        self.peers.close()
        if self.rl.weight_sync.mode == "disk":  # a copy of the model no one loads any more
            _prune(os.path.join(self.master.boot.trial_dir, "weights"), keep=None)


def group_ranks(model_devices: Sequence[str], gen_devices: Sequence[str], replica: int,
                tp: int) -> list[RankDevice]:
    """The ranks of replica ``replica``'s weight-update group with their devices: every model
    worker (``model-<rank>``), then the replica's ``tp`` vLLM workers (``generation-<replica>
    tp<rank>``). A server that did not say where its workers are is taken to be on the CPU
    (gloo works everywhere)."""
    if gen_devices and len(gen_devices) != tp:
        raise ValueError(f"generation server {replica} reports {len(gen_devices)} devices for "
                         f"tensor_parallel_size={tp}")
    gens = list(gen_devices) or [CPU] * tp
    return ([RankDevice(f"model-{i}", d) for i, d in enumerate(model_devices)]
            + [RankDevice(f"generation-{replica} tp{t}", d) for t, d in enumerate(gens)])


def train_layout(actor: TorchEngineConfig, n_model: int) -> TrainLayout:
    """The training layout of ``n_model`` model workers: FSDP is data parallel over all of
    them; megatron is tp x pp x (the rest)."""
    if actor.backend == "megatron":
        tp, pp = actor.megatron.tp, actor.megatron.pp
        return TrainLayout(dp=n_model // (tp * pp), tp=tp, pp=pp)
    return TrainLayout(dp=n_model)


def sum_stats(outs: list[TrainStats], averaged: tuple[str, ...] = ("grad_norm", "seconds")
              ) -> TrainStats:
    """Each rank's loss is already its share of the global token mean, so the sum is the loss;
    ``*_sum`` figures and ``tokens`` add up; the per-rank figures (``averaged``) are
    averaged."""
    stats: dict[str, float] = {}
    for o in outs:
        for k, v in o.items():
            stats[k] = stats.get(k, 0.0) + float(v)  # type: ignore[arg-type]
    for k in averaged:
        if k in stats:
            stats[k] /= len(outs)
    return stats  # type: ignore[return-value]


def _answer(pending: Pending[T], timeout: float = 5.0) -> T | None:
    try:
        return pending.result(timeout)
    except Exception:
        return None


def _index(name: str) -> int:
    """``kind/index`` -> index."""
    return int(name.rsplit("/", 1)[1])


def _prune(weights: str, keep: str | None) -> None:
    """Remove the published weights under ``weights`` (``v<version>`` directories) but
    ``keep``; the directory itself goes once none is kept."""
    try:
        names = os.listdir(weights)
    except FileNotFoundError:
        return
    for name in names:
        if name != keep and name.startswith("v") and name[1:].isdigit():
            shutil.rmtree(os.path.join(weights, name), ignore_errors=True)
    if keep is None:
        with contextlib.suppress(OSError):
            os.rmdir(weights)
