"""Generation servers: open vLLM and the OpenAI-compatible endpoint (guarded by the trial's API
key; none with ``generation.http=false``), serve until stopped."""
from __future__ import annotations

from typing import Any

from experiments.rl.common import load_tokenizer, model_path, rl_config
from workers.generation import GenerationServer


def generation_role(worker: GenerationServer) -> dict[str, Any]:
    rl = rl_config(worker)
    path = model_path(worker, rl)
    tok = load_tokenizer(path)
    # a weight update past the master's wait for it (it dropped this server then) is hung
    engine = worker.open_engine(path, rl.vllm, tok.eos_token_id,
                                max(rl.call_timeout, rl.weight_sync.timeout))
    try:  # (the engine is closed if the HTTP endpoint cannot start, too)
        worker.serve_http(tok, worker.boot.experiment)
        worker.serve_until_stopped()  # raises if the engine's loop dies
    finally:
        worker.close()
    return {"requests": worker.requests, "engine": dict(engine.stats), "version": engine.version}
