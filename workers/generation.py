"""Generation servers: one per generation replica; serve rollout workers' requests.

The RL role opens a :class:`~workers.engines.vllm_server.GenerationEngine` (vLLM) and an
OpenAI-compatible HTTP endpoint; the RPC surface below then serves generation (answered when the
samples are done, other calls are served meanwhile) and in-place weight updates.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from system.errors import ConfigError
from workers.base import Worker
from workers.client import WorkerClient


@dataclasses.dataclass
class GenerationServerConfig:
    """Generation servers (one per replica)."""

    count: int = 2
    """How many generation servers."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ConfigError(f"generation.count must be >= 0, got {self.count}")


class GenerationServer(Worker):
    kind = "generation"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests = 0
        self.engine: Any = None  # a GenerationEngine once the role opened one
        self.http: Any = None

    def on_configure(self, config: dict[str, Any]) -> None:
        self.gen_cfg = GenerationServerConfig(**config["worker"])

    def rpc_handlers(self) -> dict[str, Callable[..., Any]]:
        return {**super().rpc_handlers(), "echo": self.echo, "generate": self.generate,
                "weight_sync_init": self.weight_sync_init, "update_weights": self.update_weights,
                "load_weights_from_disk": self.load_weights_from_disk,
                "engine_stats": self.engine_stats}

    def open_engine(self, model_path: str, vllm_cfg: Any, eos_token_id: int | None) -> Any:
        from workers.engines.vllm_server import GenerationEngine

        self.engine = GenerationEngine(model_path, vllm_cfg, eos_token_id)
        return self.engine

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("this generation server has no engine (yet)")
        return self.engine

    def generate(self, prompt: list[int], n: int = 1, sampling: dict | None = None) -> Future:
        """``n`` samples of ``prompt`` (token ids): a list of ``{tokens, logprobs, versions,
        segments, finish}``, each token tagged with the weight version that produced it."""
        from workers.engines.vllm_server import Sampling

        self.requests += 1
        return self._engine().submit([int(t) for t in prompt], int(n), Sampling(**(sampling or {})))

    def weight_sync_init(self, spec: dict[str, Any]) -> Future:
        """Join the trainer's weight-update groups (``spec`` as for the vLLM extension, with
        this server's replica index filled in here)."""
        from system import names

        def init(llm: Any) -> Any:
            key = names.store(self.exp, self.trial, "weight_sync")
            address = self.name_resolve.wait(key, float(spec.get("timeout", 300)))
            full = {**spec, "replica": self.index, "store_address": address}
            return llm.collective_rpc("rlsys_weight_sync_init", args=(full,))
        return self._engine().control(init)

    def update_weights(self, version: int) -> Future:
        """Receive new weights in place (the trainer ranks send theirs at the same time) and
        serve them as ``version``; in-flight requests are cut or finished first (vllm.interrupt)."""
        return self._engine().control(
            lambda llm: llm.collective_rpc("rlsys_weight_sync_receive"), version=int(version))

    def load_weights_from_disk(self, directory: str, version: int) -> Future:
        """The disk fallback of :meth:`update_weights`: load a safetensors checkpoint."""
        return self._engine().control(
            lambda llm: llm.collective_rpc("rlsys_load_from_disk", args=(directory,)),
            version=int(version))

    def engine_stats(self) -> dict[str, Any]:
        e = self._engine()
        return {**e.stats, "version": e.version, "load": e.load(),
                "http": self.http.address if self.http else None}

    def echo(self, tokens: np.ndarray) -> dict[str, Any]:
        """Return the tokens with this server's identity: the transport check of the smoke
        experiment, which has no model."""
        self.requests += 1
        return {"tokens": tokens, "server": self.index, "requests": self.requests}

    def progress(self) -> dict[str, Any]:
        return {"version": self.engine.version} if self.engine is not None else {}

    def report(self) -> dict[str, Any]:
        out = {**super().report(), "requests": self.requests}
        if self.engine is not None:
            out["engine"] = {**self.engine.stats, "version": self.engine.version}
        return out


class GenerationClient(WorkerClient):
    """The generation server's RPC surface."""

    def echo(self, tokens: np.ndarray, timeout: float | None = None) -> dict[str, Any]:
        return self.rpc.call("echo", timeout, tokens=tokens)

    def submit_generate(self, prompt: list[int], n: int, sampling: dict) -> int:
        """Start a generation call; collect it with ``self.rpc.result(id, timeout)``."""
        return self.rpc.submit("generate", prompt=prompt, n=n, sampling=sampling)

    def weight_sync_init(self, spec: dict[str, Any], timeout: float | None = None) -> Any:
        return self.rpc.call("weight_sync_init", timeout, spec=spec)

    def update_weights(self, version: int, timeout: float | None = None) -> Any:
        return self.rpc.call("update_weights", timeout, version=version)

    def engine_stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self.rpc.call("engine_stats", timeout)
