"""One OpenAI request's generation: submitted to the engine with an output stream, read back as
text events per choice; the same events make a streamed answer and a whole one.

A stop string found in a sample's text ends that sample in the engine too
(``GenerationEngine.stop_samples``), and so does a reader that goes away (:meth:`close`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator

from system.errors import ConfigError
from workers.engines.http_server import HttpError
from workers.engines.openai_request import GenerationRequest
from workers.engines.openai_sessions import Reservation
from workers.engines.openai_text import Decode, SampleText
from workers.engines.output_stream import OutputStream, SampleDelta, StreamTimeout
from workers.engines.vllm_server import GenerationEngine


@dataclasses.dataclass(frozen=True)
class ChoiceEvent:
    """New text (and the tokens behind it) of choice ``index``."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    version: int
    finish: str | None
    """Set on the choice's last event."""


class Generation:
    """One submitted request (see the module's docstring)."""

    def __init__(self, engine: GenerationEngine, ids: list[int], req: GenerationRequest,
                 decode: Decode, timeout: float, record: Reservation | None = None) -> None:
        from vllm.exceptions import VLLMClientError

        self.engine, self.req, self.prompt_tokens = engine, req, len(ids)
        self._ids, self._record, self._decode = ids, record, decode
        self._lp: list[list[float]] = [[] for _ in range(req.n)]
        self._ver: list[list[int]] = [[] for _ in range(req.n)]
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._refused = (ConfigError, VLLMClientError, ValueError, TypeError)
        self.texts = [SampleText(decode, req.stop) for _ in range(req.n)]
        self.completion_tokens = 0
        self.versions: list[list[list[int]]] = [[] for _ in range(req.n)]
        """``[[version, count], ...]`` per choice."""
        self.stream = OutputStream(req.n)
        try:
            engine.submit(ids, req.n, req.sampling, self.stream)
        except RuntimeError as e:  # GenerationLoopDied, or the engine is stopping
            raise HttpError(503, f"the generation engine is not serving: {e}") from None

    def events(self) -> Iterator[ChoiceEvent]:
        """Events as the engine produces them, until every choice has finished; the engine's
        refusals and failures as :class:`HttpError`."""
        while True:
            delta = self._next()
            if delta is None:
                return
            event = self._take(delta)
            if event is not None:
                yield event

    def _next(self) -> SampleDelta | None:
        try:
            return self.stream.get(self._deadline)
        except StreamTimeout:
            self.close()
            raise HttpError(504, f"no answer within {self._timeout:g} s") from None
        except self._refused as e:  # refused in the loop
            raise HttpError(400, f"{type(e).__name__}: {str(e)[:500]}") from None
        except RuntimeError as e:
            raise HttpError(503, f"the generation engine failed: {e}") from None

    def _take(self, delta: SampleDelta) -> ChoiceEvent | None:
        text = self.texts[delta.index]
        if text.finish is not None:  # stopped here (a stop string) before the engine knew
            return None
        self.completion_tokens += len(delta.token_ids)
        runs = self.versions[delta.index]
        if delta.token_ids:
            if runs and runs[-1][0] == delta.version:
                runs[-1][1] += len(delta.token_ids)
            else:
                runs.append([delta.version, len(delta.token_ids)])
        before = len(text.tokens)
        piece = text.add(delta.token_ids, delta.finish)
        if piece.stopped:
            self.engine.stop_samples(self.stream, [delta.index])
        if self._record is not None:
            self._lp[delta.index] += delta.logprobs
            self._ver[delta.index] += [delta.version] * len(delta.token_ids)
            if piece.finish is not None:
                self._record_choice(delta.index, before, piece.stopped)
        return ChoiceEvent(delta.index, piece.text, delta.token_ids, delta.logprobs,
                           delta.top_logprobs, delta.version, piece.finish)

    def _record_choice(self, index: int, before: int, stopped: bool) -> None:
        """Record a finished choice's tokens: those the engine gave, but when a stop string
        ended it, only up to the token that completed the stop string (a delta may carry
        more)."""
        assert self._record is not None
        tokens = self.texts[index].tokens
        keep = len(tokens)
        if stopped:
            for keep in range(before + 1, len(tokens) + 1):
                if any(s in self._decode(tokens[:keep]) for s in self.req.stop):
                    break
        self._record.record(index, self._ids, tokens[:keep], self._lp[index][:keep],
                            self._ver[index][:keep], self.texts[index].finish or "stop",
                            self.req.sampling.logprob_temperature)

    def close(self) -> None:
        """Stop whatever still runs (the reader is gone or gave up); a session's choices that
        did not finish are not recorded."""
        if any(t.finish is None for t in self.texts):
            try:
                self.engine.stop_samples(self.stream)
            except ConfigError:
                pass
        if self._record is not None:
            self._record.release()

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def gather(gen: Generation) -> list[dict[str, Any]]:
    """Every choice whole: ``text``, ``token_ids``, ``logprobs``, ``top_logprobs``,
    ``finish``, ``versions`` (for a non-streamed answer)."""
    out: list[dict[str, Any]] = [{"text": "", "token_ids": [], "logprobs": [],
                                  "top_logprobs": [], "finish": None}
                                 for _ in range(gen.req.n)]
    try:
        for ev in gen.events():
            c = out[ev.index]
            c["text"] += ev.text
            c["token_ids"] += ev.token_ids
            c["logprobs"] += ev.logprobs
            c["top_logprobs"] += ev.top_logprobs
            c["finish"] = ev.finish or c["finish"]
    finally:
        gen.close()
    for c, runs in zip(out, gen.versions):
        c["versions"] = runs
    return out
