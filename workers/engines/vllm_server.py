"""The generation engine of one generation server: a vLLM engine driven by one loop thread.

Only the loop thread touches vLLM. Requests arrive from any thread (our RPC, the OpenAI HTTP
endpoint) and come back as futures; the loop adds them to vLLM's continuous batch and steps the
engine. Weight updates are control tasks run by the same loop between steps, so no token is ever
produced by a half-updated model. A request in flight at an update is either

- ``finish``: finished on the old weights before the update runs (new requests wait), or
- ``cut``: aborted, and after the update continued from where it stopped (its prompt plus the
  tokens so far) on the new weights: a partial rollout.

Every token carries the weight version that produced it; ``segments`` lists ``(version, count)``
runs per sample. A caller that wants tokens as they come (the HTTP endpoint's streaming) submits
with an :class:`~workers.engines.output_stream.OutputStream`: the loop puts each step's new
tokens there, and :meth:`GenerationEngine.stop_samples` ends samples early (a stop string, a
client that went away). The prefix cache is reset after every update (cached KV was computed with the
old weights).
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

import numpy as np

from system.errors import ConfigError
from workers.engines.output_stream import OutputStream, SampleDelta
from workers.engines.step_clock import EngineHung, GenerationLoopDied, StepClock
from workers.engines.vllm_build import check_logprobs_mode, make_llm
from workers.engines.vllm_config import (Sampling, VllmConfig, as_int, check_context,
                                         check_vocab, prompt_ids)
from workers.engines.vllm_requests import _Group, _Seq, _top, segments_of, vllm_request
from workers.engines.vllm_shutdown import shut_down

__all__ = ["GenerationEngine", "GenerationLoopDied", "Sampling", "VllmConfig", "segments_of"]

log = logging.getLogger("vllm-server")


class GenerationEngine:
    """One vLLM engine plus its loop thread."""

    def __init__(self, model_path: str, cfg: VllmConfig, eos_token_id: int | None = None) -> None:
        self._attach(make_llm(model_path, cfg), cfg, eos_token_id, owns=True)
        self.model_path = model_path

    def made_for(self, model_path: str, cfg: VllmConfig, eos_token_id: int | None) -> bool:
        """Whether this engine is what ``GenerationEngine(model_path, cfg, eos_token_id)``
        would build (a warm spare's, built ahead of a restart)."""
        return (self.model_path == model_path and self.cfg == cfg and self.eos == eos_token_id
                and self.error is None)

    @classmethod
    def from_llm(cls, llm: Any, cfg: VllmConfig, eos_token_id: int | None = None
                 ) -> "GenerationEngine":
        """Drive an existing ``vllm.LLM`` (made with ``skip_tokenizer_init=True`` and the weight
        sync extension); :meth:`close` then stops the loop but leaves the engine running."""
        self = cls.__new__(cls)
        self._attach(llm, cfg, eos_token_id, owns=False)
        self.model_path = ""
        return self

    def _attach(self, llm: Any, cfg: VllmConfig, eos_token_id: int | None, owns: bool) -> None:
        self.cfg = cfg
        self.llm = llm
        self._owns = owns
        self.engine = self.llm.llm_engine
        check_logprobs_mode(self.engine.model_config)
        self.eos = eos_token_id
        self.version = 0
        self.vocab_size = int(self.engine.model_config.get_vocab_size())
        # before the loop starts (only it touches vLLM afterwards)
        self.devices: tuple[str, ...] = tuple(
            str(d) for d in llm.collective_rpc("rlsys_device_identity"))
        """The physical identity of each vLLM worker's device, by tensor-parallel rank (``cpu``
        or ``GPU-<uuid>``): the weight-sync backend depends on them."""
        self.error: GenerationLoopDied | None = None
        """Why the loop died (``None`` while it runs): the generation server fails with it."""
        self._cv = threading.Condition()
        self._incoming: collections.deque[_Seq] = collections.deque()
        self._controls: collections.deque[tuple[Callable[[Any], Any], int | None, Future]] = \
            collections.deque()
        self._active: dict[str, _Seq] = {}
        self._stops: collections.deque[tuple[_Group, tuple[int, ...]]] = collections.deque()
        self._ids = itertools.count()
        self._stop = False
        self._clock = StepClock(cfg.step_timeout)
        self._control: tuple[Future, list[_Seq]] | None = None
        """The control task running: its future, and the samples it cut (held until it ends)."""
        self.stats = {"requests": 0, "samples": 0, "tokens": 0, "cut": 0, "updates": 0,
                      "update_seconds": 0.0}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vllm-loop", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="vllm-watch", daemon=True).start()

    # --- from any thread ---
    def submit(self, prompt: list[int], n: int, sampling: Sampling,
               stream: OutputStream | None = None) -> Future:
        """``n`` samples of one prompt; the future resolves to a list of sample dicts. With
        ``stream``, every step's new tokens also go there as they come (and the stream ends when
        the future settles). A request this engine cannot serve raises
        :class:`~system.errors.ConfigError` here, before it reaches the loop thread."""
        n = as_int("n", n, lo=1)
        if not isinstance(sampling, Sampling):
            raise ConfigError(f"sampling must be a Sampling, got {type(sampling).__name__}")
        ids = prompt_ids(prompt, self.vocab_size)
        check_context(len(ids), sampling.max_tokens, self.cfg.max_model_len)
        check_vocab("stop_token_ids", sampling.stop_token_ids, self.vocab_size)
        self.check()
        if stream is not None and stream.n != n:
            raise ConfigError(f"the output stream is for n={stream.n}, the request has n={n}")
        fut: Future = Future()
        group = _Group(fut, [], n, time.monotonic(), stream)
        group.seqs = [_Seq(next(self._ids), list(ids), sampling, group, i) for i in range(n)]
        if stream is not None:
            stream.request = group
            fut.add_done_callback(lambda f: stream.end(f.exception()))
        with self._cv:
            self._check_open()
            self._incoming.extend(group.seqs)
            self.stats["requests"] += 1
            self._cv.notify()
        return fut

    def stop_samples(self, stream: OutputStream, indices: "list[int] | None" = None) -> None:
        """End samples ``indices`` (all: None) of the request behind ``stream`` now, as finished
        with reason ``stop`` (the reader found a stop string, or went away); vLLM stops
        computing them at the loop's next turn. Samples already finished are left as they are."""
        group = stream.request
        if not isinstance(group, _Group):
            raise ConfigError("this output stream was not submitted to this engine")
        chosen = tuple(range(len(group.seqs)) if indices is None else indices)
        with self._cv:
            if self._stop:
                return
            self._stops.append((group, chosen))
            self._cv.notify()

    def control(self, fn: Callable[[Any], Any], version: int | None = None) -> Future:
        """Run ``fn(llm)`` on the loop thread at a safe point (the weight update); afterwards the
        engine's version becomes ``version`` (if given) and cut requests continue."""
        self.check()
        fut: Future = Future()
        with self._cv:
            self._check_open()  # a stopped loop would never run it
            self._controls.append((fn, version, fut))
            self._cv.notify()
        return fut

    def limit_controls(self, seconds: float) -> None:
        """Judge the engine hung when a control task runs past ``seconds`` (0: never)."""
        self._clock.control_limit = seconds

    def check(self) -> None:
        """Raise :attr:`error` if the loop has died. Also notice a death the loop cannot see:
        when vLLM's engine core process is killed (the OOM killer), ``engine.step()`` waits
        forever for outputs that never come, so the loop hangs instead of raising; likewise
        for a core that lives but hangs (:mod:`workers.engines.step_clock`)."""
        if self.error is None and not self._stop and self._core_dead():
            self._die(RuntimeError("the vLLM engine core process died"))
        hung = "" if self.error is not None or self._stop else self._clock.overdue()
        if hung:
            self._die(EngineHung(hung))
        if self.error is not None:
            raise GenerationLoopDied(str(self.error)) from self.error.__cause__

    def _core_dead(self) -> bool:
        if not self._thread.is_alive():
            return True
        resources = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        return bool(getattr(resources, "engine_dead", False))  # set by vLLM's core monitor

    def _check_open(self) -> None:
        """Refuse new work once the loop is gone (call with ``self._cv`` held)."""
        if self.error is not None:
            raise GenerationLoopDied(str(self.error)) from self.error.__cause__
        if self._stop:
            raise RuntimeError("generation engine is stopped")

    def load(self) -> int:
        """Samples queued or running (for least-outstanding routing)."""
        with self._cv:
            return len(self._incoming) + len(self._active)

    def close(self, teardown: bool = True) -> None:
        """Stop the loop, and shut vLLM's engine down (``teardown=False``: the process exits
        next; see :mod:`workers.engines.vllm_shutdown`)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._closed.set()
        self._thread.join(timeout=1 if self.error is not None else 30)  # a dead core: it hangs
        if self._owns:  # a core that died or hangs is not waited for
            shut_down(self.engine.engine_core, teardown, None if self.error is None else 0.0)

    def _watch(self, period: float = 0.5) -> None:
        """Fail the loop when vLLM's engine core dies under it without an exception (see
        :meth:`check`): nobody else may be asking."""
        while not self._closed.wait(period):
            try:
                self.check()
            except GenerationLoopDied:
                return

    # --- the loop thread ---
    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except Exception as e:
            self._die(e)
        else:
            self._fail_all(RuntimeError("generation engine stopped"))

    def _turn(self) -> bool:
        """One pass of the loop: wait for work, then run a control task or add what arrived and
        step the engine. ``False`` once stopped."""
        with self._cv:
            while not (self._stop or self._controls or self._incoming or self._active
                       or self._stops):
                self._cv.wait()
            if self._stop:
                return False
            stops = list(self._stops)
            self._stops.clear()
            # a pending control runs now (cut), or once the running samples finish (finish);
            # either way nothing new is admitted before it
            control = bool(self._controls)
            run_control = control and not (self.cfg.interrupt == "finish" and self._active)
            incoming: list[_Seq] = []
            if not control:
                while self._incoming:
                    incoming.append(self._incoming.popleft())
        for group, indices in stops:
            self._stop_group(group, indices)
        if run_control:
            self._run_control()
            return True
        for seq in incoming:
            self._admit(seq)
        if self._active:
            self._step()
        return True

    def _die(self, e: Exception) -> None:
        """The loop raised (the engine core died, a device error) or hangs on a dead core: record
        why, refuse new work and fail every waiter at once rather than leave them hanging."""
        err = GenerationLoopDied(f"generation loop died: {type(e).__name__}: {e}")
        err.__cause__ = e
        with self._cv:
            if self.error is not None:  # already failed (the hang was noticed first)
                return
            self.error = err
            self._stop = True
            self._cv.notify_all()
        log.error("generation loop died: %s: %s", type(e).__name__, e, exc_info=e)
        self._fail_all(err)

    def _admit(self, seq: _Seq) -> None:
        """Add one sample to vLLM's batch. A failure here (vLLM refusing the request) fails its
        group only; a dead engine core ends the loop."""
        if seq.group.future.done() or seq.finish:  # a sibling was refused, or it was stopped
            return
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            self._add(seq)
        except EngineDeadError:
            raise
        except Exception as e:
            log.warning("request %s refused: %s: %s", seq.sid, type(e).__name__, e)
            self._fail_group(seq.group, e)

    def _fail_group(self, group: _Group, e: Exception) -> None:
        """Fail one request (all its samples) and take its running samples out of vLLM; the
        others in the batch go on."""
        try:  # first: an abort that raises (a dead engine) ends the loop
            group.future.set_exception(e)
        except InvalidStateError:
            pass
        running = [s.rid for s in group.seqs if self._active.get(s.rid) is s]
        for rid in running:
            del self._active[rid]
        if running:
            self.engine.abort_request(running)

    def _stop_group(self, group: _Group, indices: tuple[int, ...]) -> None:
        """:meth:`stop_samples` on the loop thread: abort what runs, mark the rest (a sample
        waiting to be admitted, or cut at an update, is then never admitted)."""
        if group.future.done():
            return
        for i in indices:
            seq = group.seqs[i] if 0 <= i < len(group.seqs) else None
            if seq is None or seq.finish:
                continue
            if self._active.get(seq.rid) is seq:
                del self._active[seq.rid]
                self.engine.abort_request([seq.rid])
            seq.finish = "stop"
            self._done(seq)

    def _add(self, seq: _Seq) -> None:
        prompt, params = vllm_request(seq, self.eos)
        seq.rid = f"{seq.sid}.{seq.segments}"
        seq.segments += 1
        self._active[seq.rid] = seq
        self.engine.add_request(seq.rid, prompt, params)

    def _step(self) -> None:
        """Step the engine (its failure is the loop's) and hand each output to its sample (a
        failure there is that request's). The watch judges a step that never returns."""
        with self._clock.step():
            outs = self.engine.step()
        for out in outs:
            seq = self._active.get(out.request_id)
            if seq is None:
                continue
            try:
                self._take(seq, out)
            except Exception as e:
                log.warning("request %s failed: %s: %s", seq.sid, type(e).__name__, e,
                            exc_info=e)
                self._fail_group(seq.group, e)

    def _take(self, seq: _Seq, out: Any) -> None:
        o = out.outputs[0]
        ids = list(o.token_ids)
        start = len(seq.logprobs)
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
        stream = seq.group.stream
        if stream is not None and (ids or out.finished):
            k = seq.sampling.top_logprobs
            top = tuple(_top(d, k) for d in o.logprobs) if k and o.logprobs else ((),) * len(ids)
            stream.put(SampleDelta(seq.index, tuple(ids), tuple(seq.logprobs[start:]), top,
                                   self.version, seq.finish or None))
        if out.finished:
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
        with self._cv:  # (all of it failed with the rest if the engine is judged hung in it)
            fn, version, fut = self._controls.popleft()
            cut = list(self._active.values())  # interrupt=cut: stopped here, continued after
            self._active.clear()
            self._control = (fut, cut)
        if cut:
            self.engine.abort_request([seq.rid for seq in cut])
            self.stats["cut"] += len(cut)
        t0 = time.perf_counter()
        try:
            with self._clock.control():
                result = fn(self.llm)
                self.llm.reset_prefix_cache()
            if version is not None:
                self.version = version
            self.stats["updates"] += 1
            self.stats["update_seconds"] += time.perf_counter() - t0
            fut.set_result(result)
        except Exception as e:
            if not fut.done():
                fut.set_exception(e)
        with self._cv:  # continue the cut ones first
            self._control = None
            self._incoming.extendleft(reversed(cut))

    def _fail_all(self, e: BaseException) -> None:
        with self._cv:
            seqs = list(self._incoming) + list(self._active.values())
            self._incoming.clear()
            running = list(self._active)
            self._active.clear()
            controls = list(self._controls)
            self._controls.clear()
            running_control, held = self._control or (None, [])
            futures = [s.group.future for s in seqs + held] + [fut for _, _, fut in controls] + (
                [running_control] if running_control is not None else [])
        try:  # a live engine (one we do not own) must not keep generating for nobody
            if running and threading.current_thread() is self._thread:  # only it touches vLLM
                self.engine.abort_request(running)
        except Exception as abort_error:
            log.warning("could not abort %d requests: %s", len(running), abort_error)
        for fut in futures:
            try:
                fut.set_exception(e)
            except InvalidStateError:  # settled meanwhile (or a sibling sample's group)
                pass
