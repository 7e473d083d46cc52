"""Receiving side of weight resharding inside vLLM's workers.

Mixed into vLLM's worker with ``LLM(..., worker_extension_cls=
"workers.engines.vllm_weight_sync.WeightSyncExtension")`` and driven from the engine side with
``llm.collective_rpc("rlsys_weight_sync_init", args=(spec, replica, store_address, prefix))``
and ``llm.collective_rpc("rlsys_weight_sync_receive")`` (blocking: the trainer ranks run their
half concurrently).

Two ways to land the weights:

- ``fast`` (default): each vLLM tp rank receives exactly its own shard of every parameter, in
  vLLM's fused naming, written straight into the parameter. Where vLLM on CPU has repacked a
  linear layer's weight for its GEMM kernels (the parameter is then empty), the shard lands in
  a tensor of the planned shape and the layer is repacked with vLLM's own dispatch, as at load
  time. On CUDA every parameter is written in place.
- ``load_weights`` (fallback): every rank receives full Hugging Face tensors and hands them to
  ``model_runner.reload_weights``, which does vLLM's own fusion and sharding.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from system.rendezvous import join_store
from system.reshard.backend import device_identity
from system.reshard.params import DstParam, UnmappedWeightError
from system.reshard.spec import WeightSyncSpec


@dataclasses.dataclass
class _SyncState:
    """What one vLLM worker keeps between updates."""

    spec: WeightSyncSpec
    params: list[DstParam]
    executor: Any
    store: Any
    dtype: torch.dtype
    device: torch.device


class WeightSyncExtension:
    """Methods added to vLLM's worker class (``self`` is the vLLM worker)."""

    def rlsys_weight_sync_init(self, spec: dict[str, Any], replica: int, store_address: str,
                               store_prefix: str) -> dict[str, Any]:
        """Join the weight-update groups as generation replica ``replica``: ``spec`` is a
        :class:`~system.reshard.spec.WeightSyncSpec` on the wire, ``store_address`` the
        ``host:port`` of the trainer's TCPStore and ``store_prefix`` its group's key prefix
        (:func:`system.rendezvous.store_prefix`: derived from the trial secret, which never
        reaches vLLM's processes)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        sync = WeightSyncSpec.from_wire(spec)
        tp_rank = get_tensor_model_parallel_rank()
        rank = sync.gen_rank(replica, tp_rank)
        if sync.fused:  # refused before joining any group
            _check_all_planned(self.model_runner.model, sync.dst_params(tp_rank))
        store = join_store(store_address, sync.world_size, sync.timeout, store_prefix)
        device = next(self.model_runner.model.parameters()).device
        self._rlsys_sync = _SyncState(sync, sync.dst_params(tp_rank),
                                      sync.executor(rank, store, device), store,
                                      getattr(torch, sync.dtype), device)
        return {"rank": rank, "tp_rank": tp_rank, "mode": sync.mode,
                "buckets": len(self._rlsys_sync.executor.buckets)}

    def rlsys_device_identity(self) -> str:
        """The physical identity of this vLLM worker's device (``cpu`` or ``GPU-<uuid>``): the
        master picks the weight-sync backend from every rank's."""
        return device_identity(next(self.model_runner.model.parameters()).device)

    def rlsys_load_from_disk(self, directory: str) -> dict[str, Any]:
        """The disk fallback: load a Hugging Face safetensors checkpoint (as the trainer wrote
        it) through vLLM's own loader, in place."""
        import glob
        import os

        from safetensors.torch import load_file

        t0 = time.perf_counter()
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {directory}")

        def tensors():
            for f in files:
                yield from load_file(f).items()

        self.model_runner.reload_weights(weights_iterator=tensors())
        return {"mode": "disk", "seconds": time.perf_counter() - t0, "files": len(files)}

    def rlsys_weight_sync_receive(self) -> dict[str, Any]:
        """Receive one full weight update (blocks until the trainer ranks have sent theirs)."""
        state: _SyncState = self._rlsys_sync
        model = self.model_runner.model
        t0 = time.perf_counter()
        if state.spec.mode == "load_weights":
            full = {p.name: torch.empty(p.shape, dtype=state.dtype, device=state.device)
                    for p in state.params}
            stats = state.executor.run(dst=full)
            self.model_runner.reload_weights(weights_iterator=iter(full.items()))
            return {"mode": "load_weights", "seconds": time.perf_counter() - t0,
                    "bytes_received": stats.bytes_received, "transfer_seconds": stats.seconds}
        live = dict(model.named_parameters())
        targets: dict[str, torch.Tensor] = {}
        repack: list[str] = []
        for p in state.params:
            param = live.get(p.name)
            if param is None:
                raise KeyError(f"vLLM has no parameter {p.name}")
            if tuple(param.shape) == tuple(p.shape):
                targets[p.name] = param.data          # written in place
            elif (state.spec.dst.tp == 1 and param.dim() == len(p.shape) and param.shape[0] > p.shape[0]
                  and tuple(param.shape[1:]) == tuple(p.shape[1:])):
                # vocabulary padded by vLLM (to a multiple of 64): the real rows come first
                targets[p.name] = param.data[:p.shape[0]]
            elif param.numel() == 0:                  # repacked by vLLM's CPU GEMM dispatch
                # in vLLM's dtype (the emptied weight keeps it), not the trainer's: the GEMM
                # dispatch picks its kernel by the weight's dtype (bfloat16 weights under a
                # float32 model gave NaN log-probs)
                targets[p.name] = torch.empty(p.shape, dtype=param.dtype, device=state.device)
                repack.append(p.name)
            else:
                raise ValueError(f"{p.name}: vLLM holds {tuple(param.shape)}, the plan expects "
                                 f"{tuple(p.shape)}; use mode=load_weights")
        with torch.no_grad():
            stats = state.executor.run(dst=targets)
            self._rlsys_repack(model, repack, targets)
        return {"mode": "fast", "seconds": time.perf_counter() - t0, "repacked": len(repack),
                "bytes_received": stats.bytes_received, "transfer_seconds": stats.seconds}

    @staticmethod
    def _rlsys_repack(model: torch.nn.Module, names: list[str],
                      targets: dict[str, torch.Tensor]) -> None:
        """Repack CPU linear layers whose weights were replaced, and lm_head / embeddings that
        keep a packed copy next to their weight."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for name in names:
            module = model.get_submodule(name.rsplit(".", 1)[0])
            module.weight = torch.nn.Parameter(targets[name], requires_grad=False)
            dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        for _, module in model.named_modules():
            if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None \
                    and module.weight.numel() > 0:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _check_all_planned(model: torch.nn.Module, params: list[DstParam]) -> None:
    """Refuse (one line naming it) a vLLM parameter the plan never writes: in fast mode it would
    keep its old weights after every update."""
    planned = {p.name for p in params}
    for name, _ in model.named_parameters():
        if name not in planned:
            raise UnmappedWeightError(
                f"vLLM parameter {name!r} is not mapped by the weight-sync specs (known "
                "families: Qwen2, Llama, Qwen3); fast mode would leave it stale")
