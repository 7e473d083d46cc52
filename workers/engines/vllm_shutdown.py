"""Shut a vLLM engine core down, or leave an in-process one to the process's exit.

vLLM's own tear-down of an engine core that runs in this process (``InprocClient``: the CPU
default, ``rl.vllm.engine_process=inline``) frees its memory: a garbage collection of the whole
heap and its world-of-one process group, 2.5 s on two cores for arith-tiny's engine. When the
process exits next that buys nothing, so :func:`shut_down` with ``teardown=False`` skips it
(and the ``weakref.finalize`` that would run it at exit). An engine core in a process of its
own is always shut down: that ends the process, SIGTERM then SIGKILL after vLLM's 5 s grace,
or at once (``grace=0``) for a core that died or hangs: a stopped one would wait out the grace
(a hung server then reported its failure, and was replaced, 6 s late).
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vllm-server")


def shut_down(core: Any, teardown: bool = True, grace: float | None = None) -> None:
    """Shut ``core`` (an ``LLMEngine``'s ``engine_core`` client) down; see the module
    (``grace``: seconds its processes get before SIGKILL; ``None``: vLLM's)."""
    from vllm.v1.engine.core_client import InprocClient

    if not teardown and isinstance(core, InprocClient):
        finalizer = getattr(core, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        return
    try:
        core.shutdown(timeout=grace)
    except Exception:
        log.exception("vLLM shutdown failed")
