"""Making a generation server's vLLM engine: refused settings first (one line, before vLLM fails
at every restart), then ``vllm.LLM`` with the weight-sync extension and the log-probs the loss
needs, its files kept out of /tmp."""
from __future__ import annotations

import os
from typing import Any

from system.errors import ConfigError
from workers.engines.vllm_config import (LOGPROBS_MODE, VllmConfig,
                                         cpu_tensor_parallel_problem, memory_nodes)
from workers.engines.vllm_logs import quiet_skipped_tokenizer_warmup
from workers.engines.vllm_memory import kv_cache_problem, kv_cache_refused
from workers.engines.vllm_tmp import engine_temp_dir

WEIGHT_SYNC_EXTENSION = "workers.engines.vllm_weight_sync.WeightSyncExtension"


def make_llm(model_path: str, cfg: VllmConfig) -> Any:
    """A ``vllm.LLM`` of ``model_path`` as ``cfg`` and this device make it (see
    :meth:`VllmConfig.engine_args`); raises :class:`ConfigError` for a KV cache or CPU split
    that cannot work."""
    import torch
    from vllm import LLM
    from vllm import envs as vllm_envs

    on_gpu = torch.cuda.is_available()
    problem = kv_cache_problem(cfg, model_path, on_gpu) or (
        None if on_gpu else cpu_tensor_parallel_problem(
            cfg.tensor_parallel_size, memory_nodes(os.environ), os.environ,
            key="rl.vllm.tensor_parallel_size"))
    if problem:  # (vLLM would fail at every start, each one recovered)
        raise ConfigError(problem)
    args = cfg.engine_args(on_gpu=on_gpu)
    inline = args.inline
    # read by vLLM when the engine is made: its engine core in this process, or in its own
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inline else "1"
    # an earlier engine in this process froze vLLM's reading of its variables (set above)
    getattr(vllm_envs, "disable_envs_cache", lambda: None)()
    sized = {} if args.kv_cache_bytes is None else {"kv_cache_memory_bytes": args.kv_cache_bytes}
    quiet_skipped_tokenizer_warmup()  # (it has none on purpose)
    with engine_temp_dir(), kv_cache_refused(cfg):  # (its files: not left in /tmp)
        return LLM(model=model_path, skip_tokenizer_init=True, dtype=args.dtype,
                   enforce_eager=args.enforce_eager,
                   tensor_parallel_size=cfg.tensor_parallel_size,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   max_model_len=cfg.max_model_len, seed=cfg.seed, logprobs_mode=LOGPROBS_MODE,
                   enable_prefix_caching=cfg.enable_prefix_caching,
                   worker_extension_cls=WEIGHT_SYNC_EXTENSION,
                   distributed_executor_backend="uni" if inline else None, **sized)


def check_logprobs_mode(model_config: Any) -> None:
    """Refuse an engine whose log-probs are not those of the distribution it samples from
    (:data:`LOGPROBS_MODE`): one made elsewhere (``GenerationEngine.from_llm``) with vLLM's
    default would hand the loss untempered log-probs as the behaviour policy's."""
    mode = getattr(model_config, "logprobs_mode", None)
    if mode != LOGPROBS_MODE:
        raise ConfigError(f"the vLLM engine was made with logprobs_mode={mode!r}; the loss "
                          f"needs logprobs_mode={LOGPROBS_MODE!r} (the sampled distribution's)")
