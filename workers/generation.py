"""Generation servers: one per generation replica; serve rollout workers' requests.

A role opens a :class:`~workers.engines.vllm_server.GenerationEngine` (vLLM) with
:meth:`GenerationServer.open_engine` and an OpenAI-compatible HTTP endpoint with
:meth:`GenerationServer.serve_http`; the RPC surface below then serves generation (answered
when the samples are done, other calls are served meanwhile) and in-place weight updates.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from system import names
from system.api_key import read_api_key
from system.checks import check_count
from system.errors import ConfigError
from system.errors import NameEntryNotFound
from system.paths import TrialPaths
from system.rendezvous import store_prefix
from system.reshard.spec import WeightSyncSpec
from workers.base import Worker
from workers.client import Pending, WorkerClient
from workers.engines.http_server import HttpLimits
from workers.engines.openai_http import OpenAIEndpoint
from workers.engines.openai_sessions import SessionLimits, SessionStore
from workers.engines.vllm_server import GenerationEngine, Sampling, VllmConfig
from workers.schema import (EngineStats, Sample, SamplingParams, SessionRecord, WorkerReport,
                            WorkerSetup)

log = logging.getLogger("generation")


@dataclasses.dataclass
class GenerationServerConfig:
    """Generation servers (one per replica)."""

    count: int = 2
    """How many generation servers."""
    http: bool = True
    """Serve the OpenAI-compatible HTTP endpoint (needs the trial's api_key file; off: only our
    authenticated RPC reaches the engine)."""
    http_max_body_bytes: int = 1 << 20
    """Largest request body the endpoint reads (a larger Content-Length: 413, unread)."""
    http_max_connections: int = 32
    """Connections the endpoint serves at once (its handler threads)."""
    http_max_queued: int = 64
    """Accepted connections that may wait for a handler; any more is answered 429."""
    http_read_timeout: float = 10.0
    """Seconds a client has to send its whole request (headers and body), and to take the
    answer; a slower connection is cut (408 or closed)."""
    http_request_timeout: float = 600.0
    """Seconds a request may wait for its samples (then 504)."""
    http_max_n: int = 64
    """Most samples (n) one HTTP request may ask for."""
    session_max: int = 1024
    """Agent sessions (requests under ``/sessions/<id>/v1``) recorded at once; a request that
    would open one more is answered 429."""
    session_max_turns: int = 64
    """Choices recorded per session (a request that would exceed it: 400)."""
    session_max_tokens: int = 65536
    """Tokens recorded per session, prompts included (each request reserves prompt + max_tokens
    per choice; a request that would exceed it: 400)."""
    session_total_tokens: int = 1 << 23
    """Tokens recorded over all sessions (about 12 bytes each; beyond: 429)."""
    session_ttl: float = 600.0
    """Seconds a session may go untouched before it is dropped (its rollout worker is gone)."""

    def __post_init__(self) -> None:
        check_count("count", self.count)
        self.http_limits()  # raises for a bad http_* value
        self.session_limits()

    def session_limits(self) -> SessionLimits:
        """The bounds of recorded agent sessions (the ``session_*`` keys)."""
        names = {"max_sessions": "session_max", "max_turns": "session_max_turns",
                 "max_session_tokens": "session_max_tokens",
                 "max_total_tokens": "session_total_tokens", "ttl": "session_ttl"}
        try:
            return SessionLimits(**{k: getattr(self, v) for k, v in names.items()})
        except ConfigError as e:
            field = str(e).split(" ", 1)[0]
            raise ConfigError(f"{names.get(field, field)}{str(e)[len(field):]}") from None

    def http_limits(self) -> HttpLimits:
        """The endpoint's limits (the ``http_*`` keys)."""
        try:
            return HttpLimits(max_body_bytes=self.http_max_body_bytes,
                              max_connections=self.http_max_connections,
                              max_queued=self.http_max_queued,
                              read_timeout=self.http_read_timeout,
                              request_timeout=self.http_request_timeout, max_n=self.http_max_n)
        except ConfigError as e:
            raise ConfigError(f"http_{e}") from None


class GenerationServer(Worker):
    kind = "generation"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests = 0
        self.engine: GenerationEngine | None = None
        self.http: OpenAIEndpoint | None = None
        self.gen_cfg = GenerationServerConfig()

    def on_configure(self, config: WorkerSetup) -> None:
        self.gen_cfg = GenerationServerConfig(**config["worker"])

    def rpc_handlers(self) -> dict[str, Callable[..., Any]]:
        return {**super().rpc_handlers(), "echo": self.echo, "generate": self.generate,
                "weight_sync_init": self.weight_sync_init, "update_weights": self.update_weights,
                "load_weights_from_disk": self.load_weights_from_disk,
                "engine_stats": self.engine_stats, "take_sessions": self.take_sessions}

    # --- what a role installs ---
    def open_engine(self, model_path: str, vllm_cfg: VllmConfig, eos_token_id: int | None,
                    control_timeout: float = 0.0) -> GenerationEngine:
        """vLLM for ``model_path``: the engine a warm spare built for this restart when it is
        the same one (:attr:`prepared`), a new one otherwise. A control task (a weight
        update) running past ``control_timeout`` seconds (0: no limit) fails the server."""
        ready, self.prepared = self.prepared, None
        if isinstance(ready, GenerationEngine) and ready.made_for(model_path, vllm_cfg,
                                                                 eos_token_id):
            log.info("the engine a warm spare built is this server's")
            self.engine = ready
        else:
            if isinstance(ready, GenerationEngine):
                ready.close()
            self.engine = GenerationEngine(model_path, vllm_cfg, eos_token_id)
        self.engine.limit_controls(control_timeout)
        return self.engine

    def serve_http(self, tokenizer: Any, model_name: str) -> OpenAIEndpoint | None:
        """Open the OpenAI-compatible endpoint on this server's engine, guarded by the trial's
        API key (``<trial_dir>/api_key``), and publish its address under ``http/<index>``;
        nothing when ``generation.http`` is off."""
        cfg = self.gen_cfg
        if not cfg.http:
            return None
        key = read_api_key(TrialPaths(self.boot.trial_dir).api_key)
        self.http = OpenAIEndpoint(self._engine(), tokenizer, model_name, self.host, key,
                                   cfg.http_limits(), sessions=SessionStore(cfg.session_limits()))
        self.name_resolve.add(names.http_address(self.exp, self.trial, self.index),
                              self.http.address, replace=True)
        return self.http

    def serve_until_stopped(self, poll: float = 0.5) -> None:
        """Serve until this worker is stopped. If the engine's loop dies first, raise its error
        (:class:`~workers.engines.vllm_server.GenerationLoopDied`, naming the cause): the role
        fails, so the controller names this server and why, instead of it heart-beating on with
        an engine that answers nothing."""
        while not self.wait_stop(poll):
            if self.engine is not None:
                self.engine.check()

    def close(self) -> None:
        """Close the endpoint and the engine (the role's last step: the process exits next, so
        an engine core in this process is left to the exit to free)."""
        if self.http is not None:
            self.http.close()
        if self.engine is not None:
            self.engine.close(teardown=False)

    def _engine(self) -> GenerationEngine:
        if self.engine is None:
            raise RuntimeError("this generation server has no engine (yet)")
        return self.engine

    # --- RPC handlers ---
    def generate(self, prompt: list[int], n: int = 1,
                 sampling: SamplingParams | None = None) -> Future:
        """``n`` samples of ``prompt`` (token ids): a list of :class:`~workers.schema.Sample`,
        each token tagged with the weight version that produced it."""
        self.requests += 1
        return self._engine().submit([int(t) for t in prompt], int(n),
                                     Sampling(**(sampling or {})))

    def weight_sync_init(self, spec: dict[str, Any], group: str) -> Future:
        """Join this server's weight-update group ``group`` (the spec, a
        :class:`~system.reshard.spec.WeightSyncSpec` on the wire, has this server as its one
        replica; the trainer's rank 0 hosts the group's store under ``store/<group>``)."""
        sync = WeightSyncSpec.from_wire(spec)
        prefix = store_prefix(self.codec, group)  # the secret stays here, the prefix goes

        def init(llm: Any) -> Any:
            address = self._wait_store(group, sync.timeout)
            return llm.collective_rpc("rlsys_weight_sync_init",
                                      args=(sync.to_wire(), 0, address, prefix))
        return self._engine().control(init)

    def _wait_store(self, group: str, timeout: float) -> str:
        """The address of ``group``'s store, which the trainer's rank 0 hosts; gives up as soon
        as that worker is dead (it died while the group formed): the engine's loop must not
        wait out the timeout for it."""
        key = names.store(self.exp, self.trial, group)
        deadline = time.monotonic() + timeout
        while True:
            try:
                left = max(0.0, deadline - time.monotonic())
                return self.name_resolve.wait(key, min(0.5, left))
            except NameEntryNotFound:
                if 0 not in self.alive("model"):
                    raise RuntimeError(f"model worker 0, the host of weight-update group "
                                       f"{group}, is not alive") from None
                if time.monotonic() >= deadline:
                    raise

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

    def engine_stats(self) -> EngineStats:
        e = self._engine()
        return {**e.stats, "version": e.version, "load": e.load(),  # type: ignore[typeddict-item]
                "http": self.http.address if self.http else None, "devices": list(e.devices)}

    def take_sessions(self, sessions: list[str]) -> list[SessionRecord]:
        """The recorded turns of each agent session asked for, dropped here as they go (see
        :mod:`workers.engines.openai_sessions`); ``found`` False for one this server does not
        hold."""
        if self.http is None:
            return [{"session": str(s), "found": False, "turns": [], "pending": 0}
                    for s in sessions]
        return self.http.sessions.take([str(s) for s in sessions])

    def echo(self, tokens: np.ndarray) -> dict[str, Any]:
        """Return the tokens with this server's identity: the transport check of the smoke
        experiment, which has no model."""
        self.requests += 1
        return {"tokens": tokens, "server": self.index, "requests": self.requests}

    def progress(self) -> dict[str, Any]:
        return {"version": self.engine.version} if self.engine is not None else {}

    def report(self) -> WorkerReport:
        out = super().report()
        out["requests"] = self.requests
        if self.engine is not None:
            out["engine"] = {**self.engine.stats, "version": self.engine.version}
        return out


class GenerationClient(WorkerClient):
    """The generation server's RPC surface."""

    def echo(self, tokens: np.ndarray) -> Pending[dict[str, Any]]:
        return self._call("echo", tokens=tokens)

    def generate(self, prompt: list[int], n: int, sampling: SamplingParams
                 ) -> Pending[list[Sample]]:
        return self._call("generate", prompt=prompt, n=n, sampling=sampling)

    def weight_sync_init(self, spec: WeightSyncSpec, group: str
                         ) -> Pending[list[dict[str, Any]]]:
        return self._call("weight_sync_init", spec=spec.to_wire(), group=group)

    def update_weights(self, version: int) -> Pending[Any]:
        return self._call("update_weights", version=version)

    def load_weights_from_disk(self, directory: str, version: int) -> Pending[Any]:
        return self._call("load_weights_from_disk", directory=directory, version=version)

    def engine_stats(self) -> Pending[EngineStats]:
        return self._call("engine_stats")

    def take_sessions(self, sessions: list[str]) -> Pending[list[SessionRecord]]:
        """Fetch and drop the recorded turns of agent sessions on this server's endpoint."""
        return self._call("take_sessions", sessions=sessions)
