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
    # a weight update past the master's wait for it (it dropped this server then) is hung:
    # rl.call_timeout, a group's set-up up to twice the weight-sync timeout (the store, then
    # the group) plus the master's 30 s
    engine = worker.open_engine(path, rl.vllm, tok.eos_token_id,
                                max(rl.call_timeout, 2 * rl.weight_sync.timeout + 30))
    try:  # (the engine is closed if the HTTP endpoint cannot start, too)
        worker.serve_http(tok, worker.boot.experiment)
        worker.serve_until_stopped()  # raises if the engine's loop dies
    finally:
        worker.close()
    return {"requests": worker.requests, "engine": dict(engine.stats), "version": engine.version}
