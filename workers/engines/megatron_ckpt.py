"""This rank's share of megatron's ``DistributedOptimizer`` as plain tensors, by parameter name:
the float32 master shard, AdamW's moments and step of every parameter range this data-parallel
rank owns. A checkpoint restores into the same tp x pp x dp layout (the ranges are the
optimizer's own, derived from the same model). Uses the optimizer's per-parameter accessors of
megatron-core 0.16.1 (pinned in :mod:`workers.engines.megatron_compat`).
"""
from __future__ import annotations

from typing import Any

import torch

from workers.engines.optim_groups import configured, reapply


def _parts(optimizer: Any) -> list[Any]:
    """The ``DistributedOptimizer`` instances (``get_megatron_optimizer`` chains them)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _owned(part: Any, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters whose optimizer range lies on this data-parallel rank, by name."""
    index = part.model_param_group_index_map
    return [(n, p) for n, p in module.named_parameters() if p in index]


def optimizer_state(optimizer: Any, module: torch.nn.Module) -> dict[str, Any]:
    """``{"params": {name: {param, exp_avg, exp_avg_sq, step}}, "groups": [[...], ...]}``."""
    params, groups = {}, []
    for part in _parts(optimizer):
        for name, p in _owned(part, module):
            tensors = part._get_main_param_and_optimizer_states(p)
            params[name] = {k: v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v
                            for k, v in tensors.items()}
        groups.append([{k: v for k, v in g.items()
                        if k != "params" and isinstance(v, (int, float, bool))}
                       for g in part.optimizer.param_groups])
    return {"params": params, "groups": groups}


def load_optimizer_state(optimizer: Any, module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Put back what :func:`optimizer_state` returned (AdamW's state is created first, as its
    first step would)."""
    for part, saved_groups in zip(_parts(optimizer), state["groups"]):
        owned = _owned(part, module)
        missing = [n for n, _ in owned if n not in state["params"]]
        if missing:
            raise RuntimeError(f"optimizer checkpoint lacks {missing[:3]} "
                               "(written by another tp/pp/dp layout?)")
        if not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()
        for name, p in owned:
            saved = state["params"][name]
            current = part._get_main_param_and_optimizer_states(p)
            tensors = {k: saved[k].to(v.device, v.dtype) if isinstance(v, torch.Tensor)
                       else saved[k] for k, v in current.items()}
            part._set_main_param_and_optimizer_states(p, tensors)
        settings = configured(part.optimizer.param_groups)
        for group, saved_group in zip(part.optimizer.param_groups, saved_groups):
            group.update(saved_group)
        reapply(part.optimizer.param_groups, settings)  # a changed rl.actor.lr applies
