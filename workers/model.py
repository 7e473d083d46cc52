"""Model workers: one per device, hosting training engines (actor, reference, critic).

A role installs the engines and the loss functions with :meth:`ModelWorker.install` (losses
come from the experiment's algorithms: a worker never imports an experiment). Groups among
model workers rendezvous through :mod:`system.rendezvous` (rank 0 hosts the store), so they form
without a fixed port and independently of any default process group.

Engine calls (log-probs, train steps, weight sync, checkpoints) run on one engine thread and
are answered when done (deferred RPC replies), so the worker keeps answering control calls while
it trains. Every data-parallel rank must receive the same sequence of collective calls: the
master calls all model workers together.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from system import names
from system.checks import check_count
from system.errors import ConfigError
from system.rendezvous import host_store, lookup_store, store_prefix
from system.reshard.backend import device_identity
from system.reshard.spec import WeightSyncSpec
from workers.base import Worker
from workers.devices import check_own_devices, select_device
from workers.model_checkpoint import save_checkpoint
from workers.publish import send_shards, source_boxes
from workers.schema import EngineInfo, TrainItem, TrainStats, WeightsSent, WorkerSetup

if TYPE_CHECKING:  # torch is imported by the model worker process, not by the launcher
    import torch

    from workers.engines.torch_engine import LossFn, TorchEngine

log = logging.getLogger("model")

@dataclasses.dataclass
class ModelWorkerConfig:
    """Model (training) workers."""

    count: int = 2
    """How many model workers (one per device)."""
    group_timeout: float = 120.0
    """Seconds to wait for all ranks when a process group forms."""

    def __post_init__(self) -> None:
        check_count("count", self.count)
        if self.group_timeout <= 0:
            raise ConfigError(f"group_timeout must be > 0, got {self.group_timeout}")


class ActorLoss(Protocol):
    """Builds the per-micro-batch loss of a train step from the batch, the objective's config
    (plain values, as the master sent it) and a dict the loss adds its statistics to."""

    def __call__(self, batch: Sequence[TrainItem], cfg: dict[str, Any],
                 stats: dict[str, float]) -> "LossFn": ...


class CriticLoss(Protocol):
    def __call__(self, batch: Sequence[TrainItem], value_clip: float,
                 stats: dict[str, float]) -> "LossFn": ...


@dataclasses.dataclass
class _WeightSync:
    executor: Any
    boxes: dict[str, Any]
    store: Any
    address: str
    """Where the replica's server was registered when it joined: a server that stops serving
    there died (or was replaced), and a transfer waiting for it is given up."""


def _in_daemon_thread(fn: Callable[[], Any], name: str) -> Future:
    """``fn()`` in a daemon thread of its own; its future. (A ThreadPoolExecutor's threads
    are joined at interpreter exit, so one stuck in a dead peer's rendezvous would hold the
    process up until the group's timeout.)"""
    fut: Future = Future()

    def body() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)
    threading.Thread(target=body, name=name, daemon=True).start()
    return fut


class ModelWorker(Worker):
    kind = "model"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engines: dict[str, TorchEngine] = {}   # "actor" | "ref" | "critic"
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="engine",
                                        initializer=self._bind_thread)
        self._syncs: dict[int, _WeightSync] = {}    # generation replica -> its update group
        self._stores: list[Any] = []                # keep every group's store alive
        self._actor_loss: ActorLoss | None = None
        self._critic_loss: CriticLoss | None = None

    def on_configure(self, config: WorkerSetup) -> None:
        self.model_cfg = ModelWorkerConfig(**config["worker"])
        self.world_size = int(config["counts"]["model"])

    def on_preempt(self) -> bool:
        """Preempted: stop once the master has checkpointed (it holds this worker's weights and
        optimizer state)."""
        return self.stop_after_checkpoint()

    def rpc_handlers(self) -> dict[str, Callable[..., Any]]:
        return {**super().rpc_handlers(), "logprobs": self.logprobs, "values": self.values,
                "train_actor": self.train_actor, "train_critic": self.train_critic,
                "weight_sync_init": self.weight_sync_init, "send_weights": self.send_weights,
                "save": self.save, "save_weights": self.save_weights, "ready": self.ready,
                "engine_info": self.engine_info}

    # --- set-up (the role, on the main thread, before it reports ready) ---
    def init_default_group(self) -> None:
        """The default process group over all model workers (FSDP2's mesh needs it): gloo on
        the CPU; NCCL on GPUs, once the ranks have checked that no two of them share a GPU
        (NCCL would refuse, and gloo lacks FSDP2's collectives on CUDA: refused in one line)."""
        import torch.distributed as dist

        if self.world_size > 1 and not dist.is_initialized():
            store = self._store("default")
            backend = "nccl" if self.device.startswith("cuda") else "gloo"
            if backend == "nccl":
                import torch

                torch.cuda.set_device(self.device)
                check_own_devices(store, self.index, self.world_size,
                                  device_identity(self.device))
            dist.init_process_group(backend, store=store, rank=self.index,
                                    world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.model_cfg.group_timeout))

    def install(self, engines: "dict[str, TorchEngine]", actor_loss: ActorLoss,
                critic_loss: CriticLoss | None = None) -> None:
        """Serve ``engines`` (``actor``, and optionally ``ref`` and ``critic``) with these loss
        functions; the worker is ``ready`` from now on."""
        if "actor" not in engines:
            raise ValueError(f"install needs an actor engine, got {sorted(engines)}")
        self._actor_loss, self._critic_loss = actor_loss, critic_loss
        self.engines = dict(engines)

    def ready(self) -> bool:
        return bool(self.engines)

    def engine_info(self) -> EngineInfo:
        """The actor's publish dtype, this worker's physical device and whether its ranks hold
        FSDP2 shards (for the weight-sync spec; the master picks its backend)."""
        actor = self._engine("actor")
        return {"dtype": str(actor.dtype).replace("torch.", ""),
                "device": device_identity(self.device), "sharded": actor.sharded,
                "shape": actor.shape.to_dict()}

    def _engine(self, which: str) -> "TorchEngine":
        if which not in self.engines:
            raise RuntimeError(f"no {which!r} engine on {self.name} (have {sorted(self.engines)})")
        return self.engines[which]

    def _run(self, fn: Callable[[], Any]) -> Future:
        return self._exec.submit(fn)

    # --- engine calls ---
    def logprobs(self, seqs: list, which: str = "actor", temps: list | None = None) -> Future:
        """Per-token log-probs (float32 arrays of ``len - 1``) under ``actor`` or ``ref``, at
        the sampling temperatures ``temps`` (per sequence, its completion tokens'; empty or
        None: 1)."""
        eng, temps = self._engine(which), _temperatures(seqs, temps)
        return self._run(lambda: [t.numpy() for t in eng.logprobs(_tensors(seqs), temps)])

    def values(self, seqs: list) -> Future:
        eng = self._engine("critic")
        return self._run(lambda: [t.numpy() for t in eng.logprobs(_tensors(seqs))])

    def train_actor(self, batch: list[TrainItem], global_tokens: int, loss: dict[str, Any]
                    ) -> Future:
        eng, make_loss = self._engine("actor"), self._actor_loss
        assert make_loss is not None  # installed with the engines
        temps = _temperatures([b["tokens"] for b in batch], [b.get("temps") for b in batch])

        def step() -> TrainStats:
            stats: dict[str, float] = {}
            t0 = time.perf_counter()
            out = eng.train_step(_tensors([b["tokens"] for b in batch]),
                                 make_loss(batch, loss, stats), global_tokens, temps)
            return {**out, **stats, "seconds": time.perf_counter() - t0,  # type: ignore
                    "train_tokens": float(sum(len(b["tokens"]) for b in batch))}
        return self._run(step)

    def train_critic(self, batch: list[TrainItem], global_tokens: int, value_clip: float
                     ) -> Future:
        eng, make_loss = self._engine("critic"), self._critic_loss
        if make_loss is None:
            raise RuntimeError(f"{self.name} has no critic loss installed")

        def step() -> TrainStats:
            stats: dict[str, float] = {}
            out = eng.train_step(_tensors([b["tokens"] for b in batch]),
                                 make_loss(batch, value_clip, stats), global_tokens)
            return {**out, **stats}  # type: ignore[typeddict-item]
        return self._run(step)

    # --- weights ---
    def weight_sync_init(self, spec: dict[str, Any], group: str, replica: int) -> Future:
        """Join generation replica ``replica``'s weight-update group ``group`` as a source rank
        (rank 0 hosts its TCPStore under ``store/<group>``; the replica's vLLM workers join).
        Each replica has a group of its own, so one that dies or restarts leaves the others'
        updates alone; joining a replica again replaces its old group."""
        sync = WeightSyncSpec.from_wire(spec)

        def init() -> dict[str, Any]:
            self._drop_sync(int(replica))
            address = self.serving_at("generation", int(replica))
            if address is None:
                raise RuntimeError(f"generation server {replica} is not serving")

            actor = self._engine("actor")
            if getattr(actor, "backend", "fsdp") == "megatron":  # cut at publish from its shards
                boxes = sync.src_boxes(self.index)
            else:
                boxes = source_boxes(sync, self.index, actor.local_shards())  # refuses unmapped

            def build() -> _WeightSync:
                store = self._store(group, sync.world_size, keep=False)
                executor = sync.executor(self.index, store, actor.device)
                return _WeightSync(executor, boxes, store, address)
            done, failed = self._while_serving({int(replica): build}, {int(replica): address})
            if failed:
                raise RuntimeError(failed[int(replica)])
            self._syncs[int(replica)] = done[int(replica)]
            return {"rank": self.index, "replica": int(replica),
                    "buckets": len(done[int(replica)].executor.buckets)}
        return self._run(init)

    def send_weights(self, replicas: list[int]) -> Future:
        """Send this rank's own shards (FSDP2: its dim-0 chunks; nothing is gathered) of the
        actor's current weights, as planned, to each of
        ``replicas`` in turn (collective with the other model workers and each replica's
        ``update_weights``), all replicas at once (each has its own groups). A replica whose
        transfer fails (its server died) is left out of later updates until it joins again;
        the others still get theirs."""
        missing = [r for r in replicas if int(r) not in self._syncs]
        if missing:
            raise RuntimeError(f"weight_sync_init was not called for replica(s) {missing}")

        def send() -> WeightsSent:
            t0 = time.perf_counter()
            # a transfer queued before this one may have dropped a replica since the check above
            gone = {int(r): f"generation server {r} left the weight sync in an earlier update"
                    for r in replicas if int(r) not in self._syncs}
            live = [int(r) for r in replicas if int(r) not in gone]
            if not live:
                return {"seconds": 0.0, "bytes_sent": 0,
                        "failed": {str(r): why for r, why in gone.items()}}
            actor = self._engine("actor")
            if getattr(actor, "backend", "fsdp") == "megatron":  # boxes cut from its shards
                own = actor.publish_shards(self._syncs[live[0]].boxes)

                def one(sync: _WeightSync) -> int:
                    return sync.executor.run(src={n: own[n].contiguous() for n in sync.boxes},
                                             src_boxes=sync.boxes).bytes_sent
            else:  # FSDP: each rank its own dim-0 chunks

                def one(sync: _WeightSync) -> int:
                    return send_shards(sync.executor, actor, sync.boxes)

            # each replica's group is independent of the others': all are sent at once
            done, failed = self._while_serving(
                {r: (lambda s=self._syncs[r]: one(s)) for r in live},
                {r: self._syncs[r].address for r in live}, on_failed=self._drop_sync)
            for r, why in failed.items():
                log.warning("weight update of generation replica %d failed: %s", r, why)
                self._drop_sync(r)
            failed.update(gone)
            return {"seconds": time.perf_counter() - t0, "bytes_sent": sum(done.values()),
                    "failed": {str(r): why for r, why in failed.items()}}
        return self._run(send)

    def _while_serving(self, work: dict[int, Callable[[], Any]], addresses: dict[int, str],
                       period: float = 0.5, on_failed: Callable[[int], None] | None = None
                       ) -> tuple[dict[int, Any], dict[int, str]]:
        """Run each generation replica's part of a transfer in a thread of its own; returns
        (results, why each failed). A replica whose server stops serving at the address it
        joined from is given up at once: a peer that died before connecting is otherwise
        noticed only at the group's timeout (minutes), and the engine thread would wait that
        long. Its thread (a daemon: it never holds up this process's exit) ends at that
        timeout, or when ``on_failed(replica)``, called at once, aborts its group (NCCL: a
        broadcast stuck on the dead server could share a CUDA stream from torch's pool with a
        live replica's and hold that one up too)."""
        futures = {r: _in_daemon_thread(self._bound(fn), f"replica-{r}")
                   for r, fn in work.items()}
        done: dict[int, Any] = {}
        failed: dict[int, str] = {}
        while futures:
            wait(futures.values(), timeout=period, return_when=FIRST_COMPLETED)
            serving = self._serving_generation()  # one read of the registry per round
            for r, f in list(futures.items()):
                if f.done():
                    try:
                        done[r] = f.result()
                    except Exception as e:  # its server died mid-transfer (connection reset)
                        failed[r] = f"{type(e).__name__}: {e}"
                    del futures[r]
                elif serving is not None and serving.get(r) != addresses[r]:
                    failed[r] = f"generation server {r} stopped serving during the transfer"
                    del futures[r]
                    if on_failed is not None:
                        on_failed(r)
        return done, failed

    def _drop_sync(self, replica: int) -> None:
        """Forget ``replica``'s weight-update group, aborting it (NCCL: a transfer stuck on
        its dead server ends instead of waiting for the group's timeout)."""
        sync = self._syncs.pop(replica, None)
        if sync is not None:
            sync.executor.abort()

    def _bind_thread(self) -> None:
        """Make this worker's GPU the current device of the calling thread (CUDA's current
        device is per thread: megatron and FSDP2 create tensors and streams on it)."""
        device = self.device
        if device.startswith("cuda"):
            import torch

            torch.cuda.set_device(device)

    def _bound(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` run with this worker's GPU as the thread's current device."""
        def run() -> Any:
            self._bind_thread()
            return fn()
        return run

    def _serving_generation(self) -> dict[int, str] | None:
        """``{index: address}`` of the generation servers that heart-beat (None: name
        resolution could not be read this time; nothing is judged on it)."""
        try:
            alive = self.alive("generation")
            found = self.name_resolve.get_subtree(
                names.worker_addresses(self.exp, self.trial, "generation"))
        except Exception as e:
            log.warning("could not read the generation servers' registry: %s", e)
            return None
        out = {}
        for key, address in found.items():
            index = key.rsplit("/", 1)[1]
            if index.isdigit() and int(index) in alive:
                out[int(index)] = address
        return out

    def save_weights(self, directory: str) -> Future:
        """Write the actor as a Hugging Face safetensors checkpoint in the publish dtype: rank 0
        collects the other ranks' shards one parameter at a time and writes (collective)."""
        def save() -> dict[str, Any]:
            actor = self._engine("actor")
            if getattr(actor, "backend", "fsdp") == "megatron":
                actor.save_hf(directory, self.index)  # gathers over its model-parallel ranks
                return {"rank": self.index}
            state = actor.gather_on_rank0()
            if self.index == 0:
                os.makedirs(directory, exist_ok=True)
                self._engine("actor").model.save_pretrained(directory, state_dict=state,
                                                            safe_serialization=True)
            return {"rank": self.index}
        return self._run(save)

    def save(self, directory: str) -> Future:
        """Write every engine and this rank's RNG state under ``directory``, and digest this
        rank's share of the files (:func:`workers.model_checkpoint.save_checkpoint`).
        Collective."""
        return self._run(lambda: save_checkpoint(self.engines, directory, self.index,
                                                 self.world_size, self.device))

    # --- groups ---
    def _store(self, name: str, world: int | None = None, keep: bool = True) -> Any:
        """The TCPStore of group ``name``: rank 0 hosts it on this worker's interface under
        ``store/<name>``; its keys lie under the group's secret prefix. ``keep``: held as long
        as this worker lives (else the caller keeps it)."""
        world = world or self.world_size
        key = names.store(self.exp, self.trial, name)
        timeout = self.model_cfg.group_timeout
        prefix = store_prefix(self.codec, name)
        store = (host_store(self.name_resolve, key, self.host, world, timeout, prefix)
                 if self.index == 0 else lookup_store(self.name_resolve, key, world, timeout,
                                                      prefix, stop=lambda: self.stopping))
        if keep:
            self._stores.append(store)
        return store

    @property
    def device(self) -> str:
        """This worker's device (:func:`~workers.devices.select_device`): the one GPU its
        placement left visible (local: ``CUDA_VISIBLE_DEVICES`` per worker; Slurm: each task's
        slice), else the one at its local rank among its node's; without GPUs, the CPU."""
        import torch

        return select_device(self.local_rank,
                             torch.cuda.device_count() if torch.cuda.is_available() else 0)

    def new_group(self, name: str) -> Any:
        """A gloo process group over all model workers (rank = worker index)."""
        import torch.distributed as dist

        store = self._store(name)
        timeout = datetime.timedelta(seconds=self.model_cfg.group_timeout)
        return dist.ProcessGroupGloo(store, self.index, self.world_size, timeout)


def _tensors(seqs: list) -> list:
    import torch

    return [torch.as_tensor(s, dtype=torch.long) for s in seqs]


def _temperatures(seqs: list, temps: list | None) -> list | None:
    """The engines' per-sequence temperature tensors (None: every sequence at 1); refuses
    temperatures that are not finite numbers > 0, or more of them than a sequence has next
    tokens (a caller's bug: the RPC reports it)."""
    if temps is None or all(t is None or len(t) == 0 for t in temps):
        return None
    import torch

    if len(temps) != len(seqs):
        raise ValueError(f"{len(temps)} temperature arrays for {len(seqs)} sequences")
    out = []
    for s, t in zip(seqs, temps):
        # (a copy: the wire's arrays are read-only)
        t = torch.tensor(t if t is not None else [], dtype=torch.float32)
        if t.dim() != 1 or len(t) > len(s) - 1 or not bool(((t > 0) & t.isfinite()).all()):
            raise ValueError(f"temperatures {t.tolist()[:4]}... of a {len(s)}-token sequence "
                             "are not finite numbers > 0, one per completion token")
        out.append(t)
    return out
