"""The ``torch`` training engine: a transformers causal LM, data parallel with FSDP2.

One engine per model worker (one device each). Across model workers the model is sharded with
``fully_shard`` per decoder layer and on the whole model (gloo on CPU, NCCL on GPU); with one
worker it is a plain module. AdamW with gradient clipping. Sequences are packed into micro-batches
under a token budget; the loss is a token mean over the whole global batch, whatever the
micro-batching and data-parallel split.

Precision (:func:`precision`): on CPU the weights are float32 (``dtype=auto``) or the configured
dtype, computed as they are. On CUDA with ``dtype=auto`` or ``bfloat16`` the engine trains in
mixed precision: float32 master weights, gradients and AdamW state, bfloat16 compute (one rank:
forward and backward under ``torch.autocast``; FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, which gathers bfloat16 copies of the float32 shards for compute and
reduces gradients in float32). The log-softmax of the log-probs is always float32.
:attr:`TorchEngine.dtype` is the *publish* dtype, in which the weights leave the engine (vLLM
weight sync casts :meth:`local_shards` bucket by bucket; ``save_weights`` uses
:meth:`gather_on_rank0`); :meth:`save` keeps the float32 master weights so a resume is exact.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from system.errors import ConfigError
from system.files import fsync_path
from system.reshard.params import ModelShape
from workers.engines.configs import TorchEngineConfig
from workers.engines.optim_groups import configured, reapply
from workers.engines.temperature import Temperatures, position_temperatures, tempered


def microbatches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped so that ``max length x count <= budget`` (a longer sequence goes alone),
    longest first to keep padding low."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def precision(device_type: str, dtype: str) -> tuple[torch.dtype, torch.dtype, bool]:
    """``(master, publish, mixed)`` for a device type and ``TorchEngineConfig.dtype``: the dtype
    of the trained parameters and optimizer state, the dtype the weights leave the engine in,
    and whether compute runs in bfloat16 over float32 masters (CUDA with auto or bfloat16)."""
    publish = (torch.bfloat16 if device_type == "cuda" else torch.float32) \
        if dtype == "auto" else getattr(torch, dtype)
    mixed = device_type == "cuda" and publish == torch.bfloat16
    return (torch.float32 if mixed else publish), publish, mixed


def mixed_precision_policy(mixed: bool) -> dict[str, torch.dtype | None]:
    """The arguments of FSDP2's ``MixedPrecisionPolicy``: under mixed precision the float32
    shards are all-gathered as bfloat16 for compute and gradients reduced in float32 (the
    optimizer and its state stay float32); otherwise parameters compute as they are."""
    if mixed:
        return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    return {"param_dtype": None, "reduce_dtype": None}


# loss_fn(per-sequence token log-probs, indices of those sequences in the batch) -> summed loss
LossFn = Callable[[list[torch.Tensor], list[int]], torch.Tensor]


def without_dropout(model: torch.nn.Module) -> None:
    """Turn every dropout of ``model`` off, as megatron's engine is built: RL computes
    log-probs (and values) in eval mode and trains on them, so a dropout active in training
    would set the first update's ratio off 1 and add noise to every value target (a
    ``*ForTokenClassification`` critic drops 10% of its head's input by default)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):  # (functional, in training)
            m.attention_dropout = 0.0


def _pick(temps: Temperatures, group: list[int]) -> Temperatures:
    return None if temps is None else [temps[i] for i in group]


class TorchEngine:
    """``head="lm"``: a causal LM (actor, reference) whose outputs are per-token log-probs;
    ``head="value"``: the same backbone with a scalar head per position (the PPO critic), whose
    outputs are values. ``trainable=False`` (the reference) has no optimizer."""

    def __init__(self, cfg: TorchEngineConfig, device: str = "cpu", world_size: int = 1,
                 head: str = "lm", trainable: bool = True, fsdp: bool | None = None) -> None:
        """``fsdp``: shard with FSDP2 over the default process group (default: when
        ``world_size`` > 1; True on one rank runs the sharded code path, as ``gpu_check``
        does on one GPU)."""
        if not cfg.model_path or not os.path.isdir(cfg.model_path):
            raise ConfigError(f"model_path={cfg.model_path!r} is not a local directory")
        if head not in ("lm", "value"):
            raise ConfigError(f"engine head={head!r} is not one of lm, value")
        self.cfg = cfg
        self.head = head
        self.trainable = trainable
        self.device = torch.device(device)
        self.world_size = world_size
        self._fsdp = world_size > 1 if fsdp is None else fsdp
        # dtype: what full_state_dict returns (the weights published to vLLM);
        # master_dtype: the parameters and AdamW state (float32 under mixed precision)
        self.master_dtype, self.dtype, self.mixed = precision(self.device.type, cfg.dtype)
        # one rank autocasts; FSDP2's MixedPrecisionPolicy casts the gathered parameters
        self._autocast = self.mixed and not self._fsdp
        model = self._load(cfg.model_path, head).to(self.device)
        without_dropout(model)
        if not trainable:
            model.requires_grad_(False)
        if self._fsdp:
            self._shard(model)
        self.model = model
        self.shape = ModelShape.from_hf(model.config)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay) if trainable else None
        self.steps = 0

    def _load(self, path: str, head: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if head == "lm":
            return AutoModelForCausalLM.from_pretrained(path, dtype=self.master_dtype,
                                                        local_files_only=True)
        return AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=self.master_dtype, local_files_only=True)

    def _shard(self, model: torch.nn.Module) -> None:
        """FSDP2 per decoder layer and on the whole model; under mixed precision the float32
        shards are gathered as bfloat16 for compute and gradients reduced in float32."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(**mixed_precision_policy(self.mixed))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    def _forward_logprobs(self, seqs: Sequence[torch.Tensor], temps: Temperatures = None
                          ) -> list[torch.Tensor]:
        """``lm``: log-prob of each next token (``len(seq) - 1`` values per sequence), the
        logits divided by each position's sampling temperature (``temps``, see
        :mod:`workers.engines.temperature`); ``value``: the value at every position but the last
        (same length)."""
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(seqs), n, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.as_tensor(s, device=self.device)
            mask[i, :len(s)] = 1
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if self._autocast else nullcontext()
        with amp:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        logits = logits.float()  # the log-softmax (and values) in float32
        if self.head == "value":
            return [logits[i, :len(s) - 1, 0] for i, s in enumerate(seqs)]
        temp = position_temperatures([len(s) for s in seqs], temps, n - 1, self.device)
        lp = torch.gather(F.log_softmax(tempered(logits[:, :-1], temp), dim=-1), 2,
                          ids[:, 1:, None])[..., 0]
        return [lp[i, :len(s) - 1] for i, s in enumerate(seqs)]

    def _groups(self, seqs: Sequence[torch.Tensor]) -> list[list[int]]:
        """Micro-batches of this rank, padded with empty ones to the largest count over the
        data-parallel ranks: every sharded forward is collective, so all ranks run as many."""
        groups = microbatches([len(s) for s in seqs], self.cfg.max_tokens_per_microbatch)
        if self.world_size > 1:
            import torch.distributed as dist

            n = torch.tensor([len(groups)], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            groups += [[] for _ in range(int(n.item()) - len(groups))]
        return groups

    _PAD = torch.zeros(2, dtype=torch.long)  # the sequence an empty micro-batch runs

    @torch.no_grad()
    def logprobs(self, seqs: Sequence[torch.Tensor], temps: Temperatures = None
                 ) -> list[torch.Tensor]:
        """Per-token log-probs of every sequence (micro-batched), on the CPU, at the sampling
        temperatures ``temps`` (None: 1). Collective over the data-parallel ranks when
        sharded."""
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for group in self._groups(seqs):
            if not group:
                self._forward_logprobs([self._PAD])
                continue
            for i, lp in zip(group, self._forward_logprobs([seqs[i] for i in group],
                                                           _pick(temps, group))):
                out[i] = lp.cpu()
        return out  # type: ignore[return-value]

    def train_step(self, seqs: Sequence[torch.Tensor], loss_fn: LossFn, global_tokens: int,
                   temps: Temperatures = None) -> dict[str, float]:
        """One optimizer step. ``loss_fn`` returns the *sum* of token losses of its sequences;
        it is divided by ``global_tokens`` (loss tokens of the whole batch over every data-parallel
        rank), so the gradient is a token mean however the batch is split. ``temps``: the
        sampling temperatures of the log-probs it gets (None: 1)."""
        if self.optimizer is None:
            raise RuntimeError("this engine is not trainable (a reference model)")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        # FSDP averages gradients over ranks: scale back to a sum over the global batch
        scale = self.world_size / max(1, global_tokens)
        for group in self._groups(seqs):
            if not group:  # keep step with the other ranks; contributes no gradient
                (self._forward_logprobs([self._PAD])[0].sum() * 0.0).backward()
                continue
            lps = self._forward_logprobs([seqs[i] for i in group], _pick(temps, group))
            loss = loss_fn(lps, group) * scale
            loss.backward()
            total += float(loss.detach()) / self.world_size
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.grad_clip if self.cfg.grad_clip > 0 else 1e30)
        self.optimizer.step()
        self.steps += 1
        return {"loss": total, "grad_norm": float(grad_norm)}

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 DTensors, each rank holding a dim-0 chunk."""
        return self._fsdp

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's own part of every parameter, in Hugging Face naming, as it lives (no copy,
        in the master dtype): when sharded, the FSDP2 DTensor's local dim-0 chunk (``torch.chunk``
        rows, :func:`system.reshard.layout.fsdp_rows`: the last ranks' may be shorter or empty),
        else the full tensor. What a publish sends: nobody gathers the model."""
        return {name: (t.to_local() if hasattr(t, "to_local") else t).detach()
                for name, t in self.model.state_dict().items()}

    def _gathered(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Full tensors in Hugging Face naming (all-gathered when sharded: collective), floating
        ones cast to ``dtype`` (before the gather, so it moves the smaller copy)."""
        out = {}
        for name, t in self.model.state_dict().items():
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = full.detach()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters in Hugging Face naming (gathered on *every* rank when sharded), in the
        publish dtype :attr:`dtype` (bfloat16 on CUDA with ``dtype=auto``). Collective when
        sharded. Publishing does not use it (:meth:`local_shards`, :meth:`gather_on_rank0`)."""
        return self._gathered(self.dtype)

    def gather_on_rank0(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full parameters on rank 0 only (``{}`` on the others), in ``dtype`` (default: the
        publish dtype; None: the master dtype), collected one parameter at a time from the
        other ranks' dim-0 chunks (point to point on the default group): no rank but 0 holds
        more than its own shards and one parameter's chunk. Collective when sharded."""
        dtype = self.dtype if dtype is None else dtype
        if not self.sharded:
            return {n: t.to(dtype) if t.is_floating_point() else t
                    for n, t in self.local_shards().items()}
        import torch.distributed as dist

        from system.reshard.layout import fsdp_rows

        rank, world = dist.get_rank(), dist.get_world_size()
        out: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}  # a tied parameter is gathered once
        for name, t in self.model.state_dict().items():
            if id(t) in seen:
                if rank == 0:
                    out[name] = out[seen[id(t)]]
                continue
            seen[id(t)] = name
            local = (t.to_local() if hasattr(t, "to_local") else t).detach()
            local = local.to(dtype) if local.is_floating_point() else local
            if not hasattr(t, "to_local"):  # not sharded: every rank holds all of it
                out.update({name: local.clone()} if rank == 0 else {})
                continue
            rows = [fsdp_rows(0, t.shape[0], world, r) for r in range(world)]
            if rank == 0:
                full = torch.empty(tuple(t.shape), dtype=local.dtype, device=local.device)
                full[slice(*rows[0])] = local
                for r in range(1, world):
                    if rows[r][1] > rows[r][0]:
                        dist.recv(full[slice(*rows[r])], src=r)
                out[name] = full
            elif local.numel() > 0:
                dist.send(local.contiguous(), dst=0)
        return out

    def save(self, directory: str, rank: int) -> None:
        """Rank 0 writes the model as a Hugging Face checkpoint (safetensors, loadable by
        transformers and vLLM) in the master dtype (float32 under mixed precision, so a resume
        is exact); every rank writes its own optimizer shard (tensors and plain values only, so
        it loads with ``weights_only=True``). Every file is fsynced by the rank that wrote it.
        Collective."""
        state = self.gather_on_rank0(self.master_dtype)
        if rank == 0:
            self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            for name in os.listdir(directory):  # what save_pretrained wrote
                if not name.startswith("optimizer.rank"):
                    fsync_path(os.path.join(directory, name))
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            # new dicts: state_dict() shares the live per-parameter state, which must keep
            # its DTensors for the steps after this save
            sd["state"] = {i: {k: v.to_local() if hasattr(v, "to_local") else v
                               for k, v in st.items()} for i, st in sd["state"].items()}
            path = os.path.join(directory, f"optimizer.rank{rank}.pt")
            torch.save({"optimizer": sd, "steps": int(self.steps)}, path)
            fsync_path(path)

    def load_optimizer(self, directory: str, rank: int) -> None:
        """Restore this rank's optimizer shard written by :meth:`save` (the model itself is
        loaded from the checkpoint directory at construction). AdamW's ``step`` counters go
        back to the CPU, where a trained engine keeps them (unless fused or capturable)."""
        if self.optimizer is None:
            return
        blob = torch.load(os.path.join(directory, f"optimizer.rank{rank}.pt"),
                          map_location=self.device, weights_only=True)
        sd = blob["optimizer"]
        params = list(self.model.parameters())
        for idx, st in sd["state"].items():
            p = params[int(idx)]
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import DTensor

                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        st[k] = DTensor.from_local(v, p.device_mesh, p.placements,
                                                   run_check=False, shape=p.shape,
                                                   stride=p.stride())
        settings = configured(self.optimizer.param_groups)
        self.optimizer.load_state_dict(sd)
        reapply(self.optimizer.param_groups, settings)  # a changed rl.actor.lr applies
        for group in self.optimizer.param_groups:
            if group.get("fused") or group.get("capturable"):
                continue
            for p in group["params"]:
                st = self.optimizer.state.get(p, {})
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].cpu()
        self.steps = int(blob.get("steps", 0))
