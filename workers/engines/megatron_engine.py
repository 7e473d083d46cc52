"""The ``megatron`` training engine: megatron-core's ``GPTModel`` over tp x pp x dp model workers.

Same surface as :class:`workers.engines.torch_engine.TorchEngine` (``logprobs``, ``train_step``
with the same loss functions, ``save`` / ``load_optimizer``, weights for publishing), so a model
worker hosts either. Ranks are megatron's (tensor-parallel fastest, then data-parallel, then
pipeline: :class:`system.reshard.layout.TrainLayout`); every rank of one data-parallel group
(its tp x pp model-parallel ranks) must be given the same sequences, and the master reads the
results of the group's last pipeline stage (tp rank 0).

Forward and backward run through megatron's pipeline schedules (``get_forward_backward_func``:
1F1B at pp > 1); the optimizer is megatron's ``DistributedOptimizer`` (AdamW over this rank's
float32 shard of its data-parallel group's parameters). Precision: on CPU everything is float32;
on CUDA (``dtype=auto`` or ``bfloat16``) the parameters compute in bfloat16 with float32 master
weights, gradients and AdamW state in the optimizer. Log-softmax is float32 always.

Losses: the loss function returns a sum of token losses over its sequences; it is divided by
``global_tokens`` (the batch's loss tokens over every data-parallel rank) and gradients are
*summed* over data-parallel ranks (``calculate_per_token_loss``), so the gradient is the token
mean of the whole batch, as in the FSDP engine.
"""
from __future__ import annotations

import json
import os
from functools import partial
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from system.errors import ConfigError
from system.files import fsync_path
from system.reshard.params import Box, ModelShape
from workers.engines import megatron_compat as compat
from workers.engines import megatron_weights as mw
from workers.engines.configs import TorchEngineConfig
from workers.engines.megatron_model import (ParallelDims, build_gpt, build_optimizer,
                                            init_parallel, transformer_config, wrap_ddp)
from workers.engines.temperature import Temperatures, position_temperatures, tempered
from workers.engines.torch_engine import LossFn, precision


class MegatronEngine:
    """``head="lm"``: per-token log-probs (actor, reference); ``head="value"``: per-position
    values (the critic). ``trainable=False`` (the reference) has no optimizer."""

    backend = "megatron"
    sharded = False  # not FSDP2 dim-0 chunks: it publishes the HF-named tp/pp boxes it cuts

    def __init__(self, cfg: TorchEngineConfig, device: str = "cpu", world_size: int = 1,
                 head: str = "lm", trainable: bool = True, seed: int = 1234) -> None:
        compat.check_version()
        if not cfg.model_path or not os.path.isdir(cfg.model_path):
            raise ConfigError(f"model_path={cfg.model_path!r} is not a local directory")
        if head not in ("lm", "value"):
            raise ConfigError(f"engine head={head!r} is not one of lm, value")
        from transformers import AutoConfig

        self.cfg, self.head, self.trainable = cfg, head, trainable
        self.device = torch.device(device)
        self.dims = ParallelDims(world_size, cfg.megatron.tp, cfg.megatron.pp)
        self.master_dtype, self.dtype, self.mixed = precision(self.device.type, cfg.dtype)
        self.hf_config = AutoConfig.from_pretrained(cfg.model_path, local_files_only=True)
        gen = os.path.join(cfg.model_path, "generation_config.json")  # read now: a resumed
        self.generation_config = (open(gen, "rb").read()  # engine's source may be pruned
                                  if os.path.isfile(gen) else None)
        self.shape = ModelShape.from_hf(self.hf_config)
        mw.kv_replicas(self.shape, self.dims.tp)  # refuses a split that cannot work
        params_dtype = torch.bfloat16 if self.mixed else self.master_dtype
        with self.shim():
            init_parallel(self.dims, self.device, seed)
            self.tcfg = transformer_config(self.hf_config,
                                           mw.megatron_shape(self.shape, self.dims.tp),
                                           self.dims, self.mixed, params_dtype)
            spec, self.te = compat.layer_spec(self.device, self.shape.qk_norm)
            module = build_gpt(self.hf_config, self.tcfg, spec, head).to(self.device)
            self.model: Any = module
            self._load_hf(cfg.model_path)
            if not trainable:
                module.requires_grad_(False)
                self.model, self.optimizer = module, None
            else:
                self.model = wrap_ddp(module, self.tcfg)
                self.optimizer = build_optimizer(self.model, cfg.lr, cfg.weight_decay,
                                                 (cfg.beta1, cfg.beta2), cfg.grad_clip,
                                                 self.mixed)
                # replicated kv heads: summed gradients (_finalize_grads), one copy in the norm
                mw.count_kv_copies_once(self.optimizer, module, self.shape, self.dims.tp)
                self.tcfg.finalize_model_grads_func = self._finalize_grads
        self.steps = 0

    # --- set-up ---
    def shim(self) -> Any:
        return compat.cpu_shim(self.device)

    @property
    def module(self) -> torch.nn.Module:
        """The ``GPTModel`` stage (unwrapped from megatron's DDP)."""
        return getattr(self.model, "module", self.model)

    @property
    def coords(self) -> tuple[int, int]:
        """``(tp_rank, pp_rank)`` of this process."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()

    def _local_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by local-spec names (TE's fused norm names translated)."""
        back = {v: k for k, v in compat.TE_NORMS.items()} if self.te else {}
        out = {}
        for name, p in self.module.named_parameters():
            for te_name, local in back.items():
                name = name.replace(te_name, local)
            out[name] = p
        return out

    def _load_hf(self, path: str) -> None:
        """Every rank reads the HF checkpoint and keeps its own shard. A critic loads its value
        head from a critic's checkpoint (``score``, as the FSDP engine saves it); from a causal
        LM's, which has none, the head keeps megatron's initialisation."""
        from safetensors.torch import load_file

        from system.reshard.megatron import VALUE_HEAD, hf_shapes

        hf: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                hf.update(load_file(os.path.join(path, name)))
        if self.shape.tie_word_embeddings:
            hf.setdefault("lm_head.weight", hf["model.embed_tokens.weight"])
        fresh = self.head == "value" and VALUE_HEAD[0] not in hf
        if self.head == "value":
            want = hf_shapes(self.shape, "value")
            if fresh:  # stand-ins of the head's shape, not loaded (below)
                hf.update({k: torch.zeros(want[k]) for k in VALUE_HEAD})
            hf.setdefault(VALUE_HEAD[1], torch.zeros(want[VALUE_HEAD[1]]))  # (as the torch
            if tuple(hf[VALUE_HEAD[0]].shape) != want[VALUE_HEAD[0]]:  # engine: a bias at 0)
                raise ConfigError(f"{path}: {VALUE_HEAD[0]} has shape "
                                  f"{tuple(hf[VALUE_HEAD[0]].shape)}; a critic's value head "
                                  f"has {want[VALUE_HEAD[0]]} (one label)")
        tp_rank, pp_rank = self.coords
        shard = mw.local_from_hf(hf, self.shape, self.dims.tp, tp_rank, self.dims.pp, pp_rank,
                                 self.head)
        params = self._local_state()
        if fresh:
            shard.pop("output_layer.weight", None)
            shard.pop("output_layer.bias", None)
        unknown = sorted(set(shard) - set(params))
        if unknown:
            raise RuntimeError(f"megatron model lacks mapped parameters {unknown[:3]}")
        with torch.no_grad():
            for name, t in shard.items():
                params[name].copy_(t.to(params[name].dtype))

    # --- forward / backward through the schedules ---
    def _microbatches(self, seqs: Sequence[torch.Tensor]) -> tuple[list[list[int]], int, int]:
        """Index groups of a fixed size (the pipeline exchanges fixed shapes), the padded
        length and the micro-batch size; at least one (empty) group."""
        n = max([len(s) for s in seqs] + [2])
        mbs = max(1, min(len(seqs), self.cfg.max_tokens_per_microbatch // n)) if seqs else 1
        groups = [list(range(i, min(i + mbs, len(seqs)))) for i in range(0, len(seqs), mbs)]
        return groups or [[]], n, mbs

    def _batch(self, seqs: Sequence[torch.Tensor], group: list[int], n: int, mbs: int
               ) -> torch.Tensor:
        ids = torch.zeros(mbs, n, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, :len(seqs[i])] = torch.as_tensor(seqs[i])
        return ids.to(self.device)

    def _outputs(self, logits: torch.Tensor, ids: torch.Tensor, lens: list[int],
                 temps: Temperatures = None) -> list[torch.Tensor]:
        """Per-sequence log-probs of the next tokens (or values) from this tp rank's logits,
        at the sampling temperatures ``temps`` (:mod:`workers.engines.temperature`)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        full = gather_from_tensor_model_parallel_region(logits).float()
        if self.head == "value":
            return [full[r, :ln - 1, 0] for r, ln in enumerate(lens)]
        rows, width = full.shape[0], full.shape[1] - 1  # (a last micro-batch's padding rows)
        pad = rows - len(lens)
        temp = position_temperatures(lens + [width + 1] * pad,
                                     None if temps is None else [*temps, *[None] * pad],
                                     width, full.device)
        z = tempered(full[:, :-1, :self.shape.vocab_size], temp, in_place=False)
        lp = torch.gather(F.log_softmax(z, dim=-1), 2, ids[:, 1:, None])[..., 0]
        return [lp[r, :ln - 1] for r, ln in enumerate(lens)]

    def _schedule(self, seqs: Sequence[torch.Tensor], forward_only: bool,
                  loss_fn: LossFn | None = None, scale: float = 1.0,
                  temps: Temperatures = None) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        groups, n, mbs = self._microbatches(seqs)
        batches = iter([(g, self._batch(seqs, g, n, mbs)) for g in groups])
        positions = torch.arange(n, device=self.device)[None].expand(mbs, n)

        def post(group: list[int], ids: torch.Tensor, logits: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            outs = self._outputs(logits, ids, [len(seqs[i]) for i in group],
                                 None if temps is None else [temps[i] for i in group])
            zero_tokens = torch.zeros((), dtype=torch.int, device=self.device)
            if forward_only:
                return logits.sum() * 0.0, zero_tokens, {"group": group, "out": outs}
            if group:
                loss = loss_fn(outs[:len(group)], group) * scale  # type: ignore[misc]
            else:  # an empty micro-batch keeps step with the pipeline; no gradient
                loss = logits.sum() * 0.0
            return loss, zero_tokens, {"loss": loss.detach()}

        def step(data: Iterator, model: Any) -> tuple[torch.Tensor, Any]:
            group, ids = next(data)
            out = model(input_ids=ids, position_ids=positions, attention_mask=None)
            return out, partial(post, group, ids)

        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=batches, model=[self.model],
            num_microbatches=len(groups), seq_length=n, micro_batch_size=mbs,
            forward_only=forward_only)

    def _finalize_grads(self, model: list[Any], num_tokens: Any = None, **kw: Any) -> None:
        """Replicated kv heads' gradients summed over their tp ranks, then megatron's own
        finalisation (data-parallel reduce-scatter, tied-embedding sync)."""
        from megatron.core.distributed import finalize_model_grads

        mw.sync_replicated_kv_grads(self.module, self.shape, self.dims.tp)
        finalize_model_grads(model, num_tokens, **kw)

    def _from_last_stage(self, flat: torch.Tensor | None, numel: int) -> torch.Tensor:
        """``flat`` (the last pipeline stage's) on every stage of this pipeline."""
        from megatron.core import parallel_state as ps

        if self.dims.pp == 1:
            assert flat is not None
            return flat
        import torch.distributed as dist

        buf = flat if flat is not None else torch.empty(numel, device=self.device)
        dist.broadcast(buf, ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        return buf

    @torch.no_grad()
    def logprobs(self, seqs: Sequence[torch.Tensor], temps: Temperatures = None
                 ) -> list[torch.Tensor]:
        """Per-token log-probs (``len - 1`` each; values for the critic) on the CPU, on every
        rank of the pipeline, at the sampling temperatures ``temps`` (None: 1). Collective over
        this rank's model-parallel group."""
        from megatron.core import parallel_state as ps

        self.model.eval()
        lens = [len(s) - 1 for s in seqs]
        with self.shim():
            store = self._schedule(seqs, forward_only=True, temps=temps)
            flat = None
            if ps.is_pipeline_last_stage():
                parts: list[Any] = [None] * len(seqs)
                for item in store:
                    for i, o in zip(item["group"], item["out"]):
                        parts[i] = o
                flat = (torch.cat([p.float() for p in parts]) if parts
                        else torch.zeros(0, device=self.device))
            flat = self._from_last_stage(flat, sum(lens))
        return [t.cpu() for t in torch.split(flat, lens)]

    def train_step(self, seqs: Sequence[torch.Tensor], loss_fn: LossFn, global_tokens: int,
                   temps: Temperatures = None) -> dict[str, float]:
        """One optimizer step (same contract as :meth:`TorchEngine.train_step`). ``loss`` is
        this data-parallel rank's share, valid on the last pipeline stage."""
        if self.optimizer is None:
            raise RuntimeError("this engine is not trainable (a reference model)")
        self.model.train()
        with self.shim():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            store = self._schedule(seqs, False, loss_fn, 1.0 / max(1, global_tokens), temps)
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step skipped (non-finite gradients)")
        self.steps += 1
        return {"loss": float(sum(float(s["loss"]) for s in store)),
                "grad_norm": float(grad_norm or 0.0)}

    # --- weights ---
    def publish_shards(self, boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
        """This rank's HF-named boxes for the reshard executor, in the publish dtype, cut from
        its own shards (collective over the tp group for the vocabulary tensors only)."""
        tp_rank, pp_rank = self.coords
        with self.shim():
            return mw.publish_boxes(self._local_state(), boxes, self.shape, self.dims.tp,
                                    tp_rank, self.dims.pp, pp_rank, self.dtype)

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The whole model in HF naming on every rank (all-gathered: for checkpoints and the
        disk fallback, never for publishing). Collective over all ranks."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        local = {k: v.detach().to(dtype or self.dtype) for k, v in self._local_state().items()}
        shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        group = ps.get_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        with self.shim():
            from system.reshard.megatron import megatron_local_params

            mshape = mw.megatron_shape(self.shape, self.dims.tp)
            for src in ranks:  # each model-parallel rank broadcasts its tensors in turn
                g = dist.get_group_rank(group, src)
                tp_rank, pp_rank = g % self.dims.tp, g // self.dims.tp
                got = {}
                for p in megatron_local_params(mshape, self.dims.tp, tp_rank, self.dims.pp,
                                               pp_rank, head=self.head):
                    buf = local[p.name].contiguous() if src == dist.get_rank() else \
                        torch.empty(p.shape, dtype=dtype or self.dtype, device=self.device)
                    dist.broadcast(buf, src, group=group)
                    got[p.name] = buf.cpu()
                shards[(tp_rank, pp_rank)] = got
        return mw.hf_from_shards(shards, self.shape, self.dims.tp, self.dims.pp, self.head)

    def save_hf(self, directory: str, rank: int, dtype: torch.dtype | None = None) -> None:
        """Write a Hugging Face checkpoint (config + safetensors; rank 0 writes). Collective.
        A critic's is a ``*ForTokenClassification`` with one label, as the FSDP engine writes
        it: either engine loads the other's weights."""
        from safetensors.torch import save_file

        state = self.full_state_dict(dtype)
        if rank != 0:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "model.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
        # what save_pretrained writes: the values that differ from the class defaults (no
        # id2label noise, no source path), and the model's generation defaults, which vLLM
        # reads when it serves the checkpoint (mode=eval, rl.model_path=<checkpoint>/actor)
        cfg = self.hf_config.to_diff_dict()
        cfg.pop("_name_or_path", None)
        cfg["dtype"] = str(dtype or self.dtype).replace("torch.", "")
        if self.head == "value":
            cfg.update(mw.critic_config(cfg))
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        written = ["model.safetensors", "config.json"]
        if self.generation_config is not None and self.head == "lm":
            with open(os.path.join(directory, "generation_config.json"), "wb") as f:
                f.write(self.generation_config)
            written.append("generation_config.json")
        for name in written:
            fsync_path(os.path.join(directory, name))

    def save(self, directory: str, rank: int) -> None:
        """The model as an HF checkpoint (rank 0, master dtype: a resume is exact) and this
        rank's optimizer shard (float32 master shard and AdamW moments, tensors and plain
        values: loads with ``weights_only=True``). Collective."""
        os.makedirs(directory, exist_ok=True)
        self.save_hf(directory, rank, self.master_dtype)
        if self.optimizer is None:
            return
        from workers.engines.megatron_ckpt import optimizer_state

        path = os.path.join(directory, f"optimizer.rank{rank}.pt")
        with self.shim():
            torch.save({"optimizer": optimizer_state(self.optimizer, self.module),
                        "steps": int(self.steps)}, path)
        fsync_path(path)

    def load_optimizer(self, directory: str, rank: int) -> None:
        """Restore this rank's optimizer shard written by :meth:`save` (same layout)."""
        if self.optimizer is None:
            return
        from workers.engines.megatron_ckpt import load_optimizer_state

        blob = torch.load(os.path.join(directory, f"optimizer.rank{rank}.pt"),
                          map_location=self.device, weights_only=True)
        with self.shim(), torch.no_grad():  # fp32 masters may be views of the parameters
            load_optimizer_state(self.optimizer, self.module, blob["optimizer"])
        self.steps = int(blob.get("steps", 0))
