"""A KV cache that cannot fit, said in the trial's keys once, not retried.

vLLM refuses an engine whose KV cache has no room (more GiB asked than a CPU node has, a memory
fraction that leaves none after the weights, no room for one ``max_model_len`` sequence) with a
``ValueError`` in its own terms (``--kv-cache-memory-bytes``, ``VLLM_CPU_KVCACHE_SPACE``). The
same settings fail the same way at every restart: :func:`kv_cache_refused` turns it into a
:class:`~system.errors.ConfigError` naming the key (the controller does not recover a
configuration error). That error reaches the generation server as such only from an engine core
in its own process (``rl.vllm.engine_process``: inline, the default on CPU at
tensor_parallel_size=1); a separate engine core (the default on GPUs) fails with vLLM's "Engine
core initialization failed", and logs its cause to the stderr it shares with the server: the
server reads that cause from what its stderr file got while the engine was built
(:func:`core_failure_cause`) and refuses it the same way. :func:`kv_cache_over_machine` refuses, at a local
trial's launch, sizes this machine's memory cannot hold, and :func:`kv_cache_under_one_sequence`
(at launch and in the generation server, before vLLM starts) an explicit size too small for
one ``max_model_len`` sequence of the model. Importable without vLLM.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from typing import Any, Iterator, Mapping

from system.errors import ConfigError
from workers.engines.vllm_config import VllmConfig

SECTION = "rl.vllm"
"""Where the engine's settings are mounted in the trial's config."""

_NODE = re.compile(r"Available memory on node (\d+) \(([\d.]+)/([\d.]+) GiB\)")
_ASKED = re.compile(r"requested memory for kv \((-?[\d.]+)")
_NO_ROOM = ("No available memory for the cache blocks",
            "larger than the available KV cache memory")


def kv_cache_refusal(error: BaseException, cfg: VllmConfig, section: str = SECTION
                     ) -> str | None:
    """One line naming the setting for vLLM's refusal ``error`` of a KV cache that cannot fit
    however often it is retried; None for any other error (and for an explicit size that fits
    the node's memory but not what other processes left free: that may pass)."""
    text = str(error)
    if not isinstance(error, ValueError):
        return None
    node = _NODE.search(text)
    if node and "requested memory for kv" in text:  # vLLM's CPU worker
        where = (f"NUMA node {node.group(1)} has {float(node.group(3)):g} GiB, "
                 f"{float(node.group(2)):g} GiB of it available")
        if cfg.kv_cache_gib is not None:
            if cfg.kv_cache_gib <= float(node.group(3)):
                return None
            return (f"{section}.kv_cache_gib={cfg.kv_cache_gib:g} does not fit this machine's "
                    f"memory ({where}); valid: fewer GiB than are available, or null (sized by "
                    f"{section}.gpu_memory_utilization)")
        asked = _ASKED.search(text)
        if asked is None or float(asked.group(1)) > 0:
            return None  # (more than other processes left free now: may pass)
        return (f"{section}.gpu_memory_utilization leaves vLLM no memory for the KV cache once "
                f"the model is loaded ({where}); valid: a larger fraction, or "
                f"{section}.kv_cache_gib=GiB")
    if any(s in text for s in _NO_ROOM):
        sizing = (f"{section}.kv_cache_gib={cfg.kv_cache_gib:g}" if cfg.kv_cache_gib is not None
                  else f"{section}.gpu_memory_utilization")
        return (f"{sizing} leaves vLLM too little memory for the KV cache of one "
                f"{section}.max_model_len={cfg.max_model_len} sequence ({text.split('. ')[0]}); "
                f"valid: more memory for the cache, or a shorter {section}.max_model_len")
    return None


CORE_FAILED = "Engine core initialization failed"
"""vLLM's error in the calling process when a separate engine core failed to start."""
_CORE_ERROR = re.compile(r"\bValueError: (.+)$")


@contextlib.contextmanager
def kv_cache_refused(cfg: VllmConfig, section: str = SECTION, fds: tuple[int, ...] = (1, 2)
                     ) -> Iterator[None]:
    """Around the engine's construction: vLLM's refusal of a KV cache that cannot fit is raised
    as a :class:`ConfigError` (:func:`kv_cache_refusal`), from an engine core in this process
    or in its own (its cause read from what this process's output files, ``fds``, got
    meanwhile: vLLM logs to stdout, tracebacks go to stderr)."""
    starts = _file_ends(fds)
    try:
        yield
    except ValueError as e:
        problem = kv_cache_refusal(e, cfg, section)
        if problem is None:
            raise
        raise ConfigError(problem) from None
    except RuntimeError as e:
        cause = core_failure_cause(starts) if CORE_FAILED in str(e) else None
        problem = None if cause is None else kv_cache_refusal(ValueError(cause), cfg, section)
        if problem is None:
            raise
        raise ConfigError(problem) from None


def _file_ends(fds: tuple[int, ...]) -> dict[int, int]:
    """The size of each distinct regular file open as one of ``fds`` (a terminal or a pipe is
    left out; a file open twice, stdout and stderr into one log, is counted once)."""
    ends: dict[int, int] = {}
    seen = set()
    for fd in fds:
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            ends[fd] = st.st_size
    return ends


def core_failure_cause(starts: dict[int, int], most: int = 1 << 20) -> str | None:
    """The last ``ValueError`` a separate engine core (or its workers) logged to the files open
    as the keys of ``starts`` since they were that many bytes long (their last ``most`` bytes
    at most), or None."""
    causes = []
    for fd, start in starts.items():
        try:
            with open(os.readlink(f"/proc/self/fd/{fd}"), "rb") as f:
                f.seek(max(start, os.fstat(f.fileno()).st_size - most))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        causes += [m.group(1).strip() for m in map(_CORE_ERROR.search, text.splitlines()) if m]
    return causes[-1] if causes else None


def machine_memory(cgroup: str = "/sys/fs/cgroup/memory.max") -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit where lower
    (0 where unknown)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 0
    try:
        with open(cgroup) as f:
            limit = f.read().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() and total else total


def kv_cache_over_machine(kv_cache_gib: float | None, total: int, engines: int = 1,
                          key: str = f"{SECTION}.kv_cache_gib", where: str = "this machine"
                          ) -> str | None:
    """Why ``engines`` KV caches of ``kv_cache_gib`` each (every tensor-parallel rank of every
    generation server of a local trial allocates its own) cannot be held in ``total`` bytes
    (0: unknown) of ``where``'s memory, or None."""
    if kv_cache_gib is None or total <= 0 or kv_cache_gib * engines * 2**30 < total:
        return None
    section = key.rpartition(".")[0]
    times = f" x {engines} engine ranks" if engines > 1 else ""
    return (f"{key}={kv_cache_gib:g}{times} is more than {where}'s memory "
            f"({total / 2**30:.1f} GiB): vLLM allocates the whole KV cache at start; valid: "
            f"fewer GiB than are free there, or null (sized by {section}.gpu_memory_utilization)")


def kv_cache_over_device(cfg: VllmConfig, on_gpu: bool, section: str = SECTION) -> str | None:
    """Why this generation server's engine cannot hold a KV cache of ``cfg.kv_cache_gib`` (per
    rank) in its device's whole memory, or None: checked before vLLM starts, whichever process
    its engine core runs in (a separate one's refusal would not reach the server)."""
    if cfg.kv_cache_gib is None:
        return None
    if not on_gpu:
        return kv_cache_over_machine(cfg.kv_cache_gib, machine_memory(),
                                     key=f"{section}.kv_cache_gib")
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return kv_cache_over_machine(cfg.kv_cache_gib, total, key=f"{section}.kv_cache_gib",
                                 where="this GPU")


DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def kv_bytes_per_token(hf: Mapping[str, Any], tp: int, dtype: str) -> int | None:
    """Bytes of KV cache one token takes on one of ``tp`` tensor-parallel ranks: keys and
    values of every layer's KV heads (replicated when fewer than the ranks). None when the
    config does not say, or the model's attention may keep less than every token (sliding
    windows, chunked or latent attention, per-layer kinds): vLLM sizes those its own way."""
    text = hf.get("text_config") or hf
    if text.get("use_sliding_window") or any(
            text.get(k) for k in ("attention_chunk_size", "kv_lora_rank")) or (
            text.get("sliding_window") and "use_sliding_window" not in text) or any(
            kind != "full_attention" for kind in text.get("layer_types") or ()):
        return None
    layers, heads = text.get("num_hidden_layers"), text.get("num_attention_heads")
    kv, hidden = text.get("num_key_value_heads") or heads, text.get("hidden_size")
    head_dim = text.get("head_dim") or (hidden // heads if isinstance(hidden, int)
                                        and isinstance(heads, int) and heads else None)
    if not all(isinstance(x, int) and x > 0 for x in (layers, kv, head_dim)):
        return None
    return 2 * layers * max(1, kv // tp) * head_dim * DTYPE_BYTES[dtype]


def kv_cache_under_one_sequence(cfg: VllmConfig, hf: Mapping[str, Any] | None, dtype: str,
                                section: str = SECTION) -> str | None:
    """Why an explicit KV cache (``kv_cache_gib``, per rank) cannot hold one ``max_model_len``
    sequence of the model whose config is ``hf`` in ``dtype`` (vLLM refuses it at every start:
    a separate engine core's refusal is recovered as any failure), or None. A lower bound (no
    block rounding): what it refuses, vLLM refuses too."""
    if cfg.kv_cache_gib is None or not hf:
        return None
    per_token = kv_bytes_per_token(hf, cfg.tensor_parallel_size, dtype)
    if per_token is None:
        return None
    needed = per_token * cfg.max_model_len
    if needed <= cfg.kv_cache_gib * 2**30:
        return None
    return (f"{section}.kv_cache_gib={cfg.kv_cache_gib:g} cannot hold the KV cache of one "
            f"{section}.max_model_len={cfg.max_model_len} sequence of this model ({per_token} "
            f"bytes a token in {dtype} per rank: {needed / 2**30:.3g} GiB); valid: "
            f"{section}.kv_cache_gib >= {needed / 2**30:.3g}, or a shorter "
            f"{section}.max_model_len")


def kv_cache_problem(cfg: VllmConfig, model_path: str, on_gpu: bool, section: str = SECTION
                     ) -> str | None:
    """What the generation server checks before vLLM starts: an explicit KV cache past its
    device's memory (:func:`kv_cache_over_device`) or too small for one sequence of the model
    at ``model_path`` (:func:`kv_cache_under_one_sequence`); None if neither."""
    problem = kv_cache_over_device(cfg, on_gpu, section)
    if problem or cfg.kv_cache_gib is None:
        return problem
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None  # (vLLM says what is wrong with the model)
    return kv_cache_under_one_sequence(cfg, hf, cfg.engine_args(on_gpu).dtype, section)
