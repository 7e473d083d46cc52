"""Model workers: one per device, hosting training engines (actor, reference, critic).

Also owns the rendezvous of torch.distributed groups among model workers: a TCPStore started by
rank 0 whose ``host:port`` is published in name resolution, so groups form without a fixed port
and independently of any default process group.

Engine calls (log-probs, train steps, weight sync, checkpoints) run on one engine thread and
are answered when done (deferred RPC replies), so the worker keeps answering control calls while
it trains. Every data-parallel rank must receive the same sequence of collective calls: the
master calls all model workers together.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from system import names
from system.errors import ConfigError
from workers.base import Worker


@dataclasses.dataclass
class ModelWorkerConfig:
    """Model (training) workers."""

    count: int = 2
    """How many model workers (one per device)."""
    group_timeout: float = 120.0
    """Seconds to wait for all ranks when a process group forms."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ConfigError(f"model.count must be >= 0, got {self.count}")
        if self.group_timeout <= 0:
            raise ConfigError(f"model.group_timeout must be > 0, got {self.group_timeout}")


class ModelWorker(Worker):
    kind = "model"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engines: dict[str, Any] = {}   # "actor" | "ref" | "critic" -> TorchEngine
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._sync: Any = None
        self.engine_info: dict[str, Any] = {}

    def on_configure(self, config: dict[str, Any]) -> None:
        self.model_cfg = ModelWorkerConfig(**config["worker"])
        self.world_size = int(config["counts"]["model"])

    def rpc_handlers(self) -> dict[str, Callable[..., Any]]:
        return {**super().rpc_handlers(), "logprobs": self.logprobs, "values": self.values,
                "train_actor": self.train_actor, "train_critic": self.train_critic,
                "weight_sync_init": self.weight_sync_init, "send_weights": self.send_weights,
                "save": self.save, "save_weights": self.save_weights, "ready": self.ready,
                "engine_info": self.engine_info_}

    # --- set-up (the RL role, on the main thread, before it reports ready) ---
    def init_default_group(self) -> None:
        """The default process group over all model workers (FSDP2's mesh needs it)."""
        import torch.distributed as dist

        if self.world_size > 1 and not dist.is_initialized():
            store = self._store("default")
            backend = "nccl" if self.device.startswith("cuda") else "gloo"
            if backend == "nccl":
                import torch

                torch.cuda.set_device(self.device)
            dist.init_process_group(backend, store=store, rank=self.index,
                                    world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.model_cfg.group_timeout))

    def ready(self) -> bool:
        return bool(self.engines)

    def engine_info_(self) -> dict[str, Any]:
        """The actor's dtype and the collective backend (for the weight-sync spec)."""
        self._engine("actor")
        return dict(self.engine_info)

    def _engine(self, which: str) -> Any:
        if which not in self.engines:
            raise RuntimeError(f"no {which!r} engine on {self.name} (have {sorted(self.engines)})")
        return self.engines[which]

    def _run(self, fn: Callable[[], Any]) -> Future:
        return self._exec.submit(fn)

    # --- engine calls ---
    def logprobs(self, seqs: list, which: str = "actor") -> Future:
        """Per-token log-probs (float32 arrays of ``len - 1``) under ``actor`` or ``ref``."""
        eng = self._engine(which)
        return self._run(lambda: [t.numpy() for t in eng.logprobs(_tensors(seqs))])

    def values(self, seqs: list) -> Future:
        eng = self._engine("critic")
        return self._run(lambda: [t.numpy() for t in eng.logprobs(_tensors(seqs))])

    def train_actor(self, batch: list[dict], global_tokens: int, loss: dict) -> Future:
        from experiments.algorithms.objectives import ActorLossConfig, actor_loss

        eng, cfg = self._engine("actor"), ActorLossConfig(**loss)

        def step() -> dict[str, float]:
            stats: dict[str, float] = {}
            t0 = time.perf_counter()
            out = eng.train_step(_tensors([b["tokens"] for b in batch]),
                                 actor_loss(batch, cfg, stats), global_tokens)
            return {**out, **stats, "seconds": time.perf_counter() - t0,
                    "train_tokens": float(sum(len(b["tokens"]) for b in batch))}
        return self._run(step)

    def train_critic(self, batch: list[dict], global_tokens: int, value_clip: float) -> Future:
        from experiments.algorithms.objectives import critic_loss

        eng = self._engine("critic")

        def step() -> dict[str, float]:
            stats: dict[str, float] = {}
            out = eng.train_step(_tensors([b["tokens"] for b in batch]),
                                 critic_loss(batch, value_clip, stats), global_tokens)
            return {**out, **stats}
        return self._run(step)

    def weight_sync_init(self, spec: dict[str, Any]) -> Future:
        """Join the weight-update groups as a source rank (rank 0 starts the TCPStore and
        publishes it under ``store/weight_sync``; the generation servers' vLLM workers join)."""
        return self._run(lambda: self._weight_sync_init(spec))

    def _weight_sync_init(self, spec: dict[str, Any]) -> dict[str, Any]:
        from system.param_specs import ModelShape, qwen2_specs
        from system.reshard_exec import GroupFactory, ReshardExecutor, train_shard_boxes
        from system.reshard_plan import plan_reshard
        from system.topology import GenLayout, TrainLayout

        src, dst = TrainLayout(**spec["src"]), GenLayout(**spec["dst"])
        shape = ModelShape(**spec["shape"])
        specs = qwen2_specs(shape)
        world = src.world_size + dst.world_size
        store = self._store("weight_sync", world)
        eng = self._engine("actor")
        fused = spec.get("mode", "fast") == "fast"
        plan_dst = dst if fused else GenLayout(tp=1, replicas=dst.world_size)
        plan = plan_reshard(src, plan_dst, specs, shape.num_layers,
                            itemsize=eng.dtype.itemsize,
                            bucket_bytes=int(spec.get("bucket_bytes", 256 << 20)), fused=fused)
        groups = GroupFactory(store, self.index, spec.get("backend", "gloo"),
                              spec.get("timeout", 300))
        self._sync = {"executor": ReshardExecutor(plan, self.index, groups, device=eng.device,
                                                  dtype=eng.dtype),
                      "boxes": train_shard_boxes(specs, src, self.index, shape.num_layers),
                      "store": store}
        return {"rank": self.index, "buckets": len(self._sync["executor"].buckets)}

    def send_weights(self) -> Future:
        """Send this rank's planned share of the actor's current weights (collective with the
        other model workers and every generation server's ``update_weights``)."""
        if self._sync is None:
            raise RuntimeError("weight_sync_init was not called")

        def send() -> dict[str, Any]:
            t0 = time.perf_counter()
            full = self._engine("actor").full_state_dict()  # FSDP: all-gather (collective)
            boxes = self._sync["boxes"]
            stats = self._sync["executor"].run(src={n: full[n].contiguous() for n in boxes},
                                               src_boxes=boxes)
            return {"seconds": time.perf_counter() - t0, "bytes_sent": stats.bytes_sent}
        return self._run(send)

    def save_weights(self, directory: str) -> Future:
        """Write the actor as a Hugging Face safetensors checkpoint (rank 0; collective)."""
        def save() -> dict[str, Any]:
            state = self._engine("actor").full_state_dict()
            if self.index == 0:
                os.makedirs(directory, exist_ok=True)
                self._engine("actor").model.save_pretrained(directory, state_dict=state,
                                                            safe_serialization=True)
            return {"rank": self.index}
        return self._run(save)

    def save(self, directory: str) -> Future:
        """Write every engine under ``directory/<engine>/`` (model: rank 0, optimizer and RNG
        state: every rank). Collective."""
        import torch

        def save() -> dict[str, Any]:
            for which, eng in self.engines.items():
                d = os.path.join(directory, which)
                os.makedirs(d, exist_ok=True)
                if which == "ref":
                    continue  # frozen: the base model is its checkpoint
                eng.save(d, self.index)
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                       os.path.join(directory, f"rng.model{self.index}.pt"))
            return {"rank": self.index}
        return self._run(save)

    def _store(self, name: str, world: int | None = None) -> Any:
        """A TCPStore for group ``name``: rank 0 hosts it and publishes its address."""
        import torch.distributed as dist

        world = world or self.world_size
        key = names.store(self.exp, self.trial, name)
        timeout = datetime.timedelta(seconds=self.model_cfg.group_timeout)
        if self.index == 0:
            store = dist.TCPStore(self.host, 0, world, is_master=True, wait_for_workers=False,
                                  timeout=timeout)
            self.name_resolve.add(key, f"{self.host}:{store.port}", replace=True)
        else:
            host, port = self.name_resolve.wait(key, self.model_cfg.group_timeout).rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
        self._stores = getattr(self, "_stores", []) + [store]  # keep the store alive
        return store

    @property
    def device(self) -> str:
        """This worker's device: under Slurm the job's GPUs are the visible ones
        (``CUDA_VISIBLE_DEVICES`` set from the allocation) and each task takes the one at its
        local rank; without GPUs, the CPU."""
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return "cpu"

    def new_group(self, name: str) -> Any:
        """A gloo process group over all model workers (rank = worker index), rendezvoused
        through a TCPStore whose address rank 0 publishes under ``store/<name>``."""
        import torch.distributed as dist

        store = self._store(name)
        timeout = datetime.timedelta(seconds=self.model_cfg.group_timeout)
        return dist.ProcessGroupGloo(store, self.index, self.world_size, timeout)


def _tensors(seqs: list) -> list:
    import torch

    return [torch.as_tensor(s, dtype=torch.long) for s in seqs]

