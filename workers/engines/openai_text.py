"""Token ids to the text an OpenAI client sees, as they come: incremental detokenization, stop
strings, and the two logprobs shapes (completions' and chat's).

vLLM runs without its tokenizer (the engine takes and gives token ids), so the endpoint decodes:
a sample's text so far is ``decode(all its tokens)``, of which the part that can no longer change
is sent. Held back: a trailing replacement character (an incomplete UTF-8 sequence of a
byte-level token), and, with stop strings, the last ``longest stop - 1`` characters (they may
become the start of a stop string). A stop string ends the sample before it; it is not sent.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

Decode = Callable[[list[int]], str]


@dataclasses.dataclass(frozen=True)
class TextPiece:
    """What one delta of a sample adds for the client."""

    text: str
    finish: str | None
    stopped: bool
    """The sample hit a stop string (the engine should stop computing it)."""


class SampleText:
    """The text of one sample, built delta by delta (see the module's docstring)."""

    def __init__(self, decode: Decode, stop: tuple[str, ...]) -> None:
        self._decode, self._stop = decode, stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        """What was sent so far."""
        self.finish: str | None = None

    def add(self, token_ids: tuple[int, ...], finish: str | None) -> TextPiece:
        """The text ``token_ids`` complete (``finish``: the engine's reason when this is the
        sample's last delta)."""
        assert self.finish is None, "a finished sample takes no more tokens"
        self.tokens.extend(token_ids)
        full = self._decode(self.tokens)
        cut = self._find_stop(full)
        if cut is not None:
            return self._end(full[:cut], "stop", stopped=True)
        if finish is not None:
            return self._end(full, finish, stopped=False)
        safe = len(full) - self._hold if self._stop else len(full)
        while safe > len(self.text) and full[safe - 1] == "\ufffd":
            safe -= 1
        piece = full[len(self.text):safe] if safe > len(self.text) else ""
        if not full.startswith(self.text):  # the decoder revised text it had given: stay put
            piece = ""
        self.text += piece
        return TextPiece(piece, None, False)

    def _find_stop(self, full: str) -> int | None:
        start = max(0, len(self.text) - self._hold)
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _end(self, final: str, finish: str, stopped: bool) -> TextPiece:
        piece = final[len(self.text):] if final.startswith(self.text) else ""
        self.text += piece
        self.finish = finish
        return TextPiece(piece, finish, stopped)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(pieces: Callable[[list[int]], list[str]], token_ids: tuple[int, ...],
                  logprobs: tuple[float, ...],
                  top: tuple[tuple[tuple[int, float], ...], ...]) -> dict[str, Any]:
    """The chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``
    (``pieces``: each token id's own text)."""
    alt_ids = [t for alts in top for t, _ in alts]
    texts = pieces(list(token_ids) + alt_ids)
    own, alt = texts[:len(token_ids)], iter(texts[len(token_ids):])
    content = []
    for text, lp, alts in zip(own, logprobs, top):
        tops = []
        for _, alp in alts:
            a = next(alt)
            tops.append({"token": a, "logprob": alp, "bytes": _bytes(a)})
        content.append({"token": text, "logprob": lp, "bytes": _bytes(text),
                        "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(pieces: Callable[[list[int]], list[str]], token_ids: tuple[int, ...],
                        logprobs: tuple[float, ...],
                        top: tuple[tuple[tuple[int, float], ...], ...], with_top: bool,
                        offset: int) -> dict[str, Any]:
    """The completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
    token, or null), ``text_offset`` (from ``offset``), and our ``token_ids``."""
    alt_ids = [t for alts in top for t, _ in alts]
    texts = pieces(list(token_ids) + alt_ids)
    own, alt = texts[:len(token_ids)], iter(texts[len(token_ids):])
    offsets = []
    for text in own:
        offsets.append(offset)
        offset += len(text)
    tops = [{next(alt): alp for _, alp in alts} for alts in top] if with_top else None
    return {"tokens": own, "token_logprobs": list(logprobs), "top_logprobs": tops,
            "text_offset": offsets, "token_ids": list(token_ids)}
