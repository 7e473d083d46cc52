"""What a warm spare of each RL worker kind imports (and reads) before it forks the kind's
workers, the first ones and every restart (:mod:`scheduler.spares`). transformers resolves its
Auto* classes lazily: importing ``modeling_auto`` is what makes a later AutoConfig /
AutoModelForCausalLM call fast (about 4 s of a cold start on two cores); vLLM's engine modules
are another 4-8 s; megatron-core's, for a trial whose actor uses it, about 3 s. A master or
rollout worker needs no torch: its spare loads the trial's tokenizer
(:mod:`experiments.rl.tokenizer`), which imports what that tokenizer needs.

A generation server's spare also builds the trial's vLLM engine ahead of need
(:data:`PREPARE`): 1.7 s of a restart on two cores with arith-tiny, more with a larger model or
KV cache. It holds that engine's memory meanwhile (about 0.9 GB for arith-tiny)."""
from __future__ import annotations

import os
from typing import Any

from system.bootstrap import Bootstrap

# ruff: noqa: F401  (imported for their side effect: loaded modules)


def _hf() -> None:
    import torch
    import transformers.models.auto.modeling_auto
    import transformers.models.auto.tokenization_auto


def _trial_rl(boot: Bootstrap) -> tuple[Any, str]:
    """The trial's validated ``rl`` section (its ``config.yaml``) and model directory."""
    from omegaconf import OmegaConf

    from experiments.rl.common import experiment_model_path, rl_section
    from system.paths import TrialPaths

    rl = rl_section(OmegaConf.load(TrialPaths(boot.trial_dir).config)["rl"])
    return rl, experiment_model_path(boot.experiment, rl)


def _tokenizer(boot: Bootstrap) -> None:
    from experiments.rl.tokenizer import load_tokenizer

    load_tokenizer(_trial_rl(boot)[1])


def master(boot: Bootstrap) -> None:
    _tokenizer(boot)
    import experiments.rl.loop


def model(boot: Bootstrap) -> None:
    _hf()
    import experiments.rl.roles.model
    import transformers.models.llama.modeling_llama
    import transformers.models.qwen2.modeling_qwen2
    import workers.engines.torch_engine
    if _trial_rl(boot)[0].actor.backend == "megatron":  # (the critic and reference follow it)
        _megatron()


def _megatron() -> None:
    """What a megatron-core model worker imports (about 3 CPU-s beyond torch on two cores, for
    every worker of a tp x pp x dp layout): only modules, no thread is started and nothing of
    CUDA is touched (:mod:`workers.engines.megatron_compat` shims calls, not imports)."""
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.parallel_state
    import megatron.core.pipeline_parallel
    import megatron.core.tensor_parallel
    import megatron.core.transformer
    import system.reshard.megatron
    import workers.engines.megatron_ckpt
    import workers.engines.megatron_engine


def generation(boot: Bootstrap) -> None:
    _hf()
    import experiments.rl.roles.generation
    import vllm.entrypoints.llm
    import vllm.model_executor.models.llama
    import vllm.model_executor.models.qwen2
    import vllm.v1.engine.core
    import vllm.v1.engine.llm_engine
    import workers.engines.vllm_server
    import workers.engines.vllm_weight_sync


def rollout(boot: Bootstrap) -> None:
    _tokenizer(boot)
    import experiments.rl.roles.rollout


WARM = {"master": master, "model": model, "generation": generation, "rollout": rollout}


def prepare_generation(boot: Bootstrap) -> Any:
    """The engine the trial's generation servers build (``rl`` of its ``config.yaml``): what
    :meth:`~workers.generation.GenerationServer.open_engine` takes over when it matches."""
    from experiments.rl.tokenizer import load_tokenizer
    from workers.engines.vllm_server import GenerationEngine

    rl, path = _trial_rl(boot)
    if rl.vllm.kv_cache_gib is None or not rl.vllm.inline(on_gpu=False):
        # (a second KV cache sized by a fraction of the machine, or engine processes outside
        # the prepared worker, are not worth holding ahead of a restart that may never come)
        raise ValueError("only an in-process engine with rl.vllm.kv_cache_gib set is prepared "
                         "ahead")
    if not os.path.isdir(path):
        raise FileNotFoundError(path)
    return GenerationEngine(path, rl.vllm, load_tokenizer(path).eos_token_id)


PREPARE = {"generation": prepare_generation}
