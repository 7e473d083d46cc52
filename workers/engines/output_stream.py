"""A per-request queue of incremental outputs, from the engine's loop thread to one reader.

The loop thread puts a :class:`SampleDelta` for every engine step that produced tokens of one of
the request's samples (the last one of a sample carries its ``finish`` reason), then ends the
stream: with nothing once every sample is done, or with the request's error. The reader (the
HTTP endpoint's handler thread, streaming or not) blocks on :meth:`OutputStream.get`; nothing
polls. Typed on purpose: this is the one shape tokens take on their way out of the loop.
"""
from __future__ import annotations

import dataclasses
import queue
import time


@dataclasses.dataclass(frozen=True)
class SampleDelta:
    """Tokens one engine step added to sample ``index`` of a request."""

    index: int
    """Which of the request's ``n`` samples."""
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each token (0.0 where vLLM gave none)."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    """Per token, the ``(token id, logprob)`` of the most likely tokens, best first (empty
    tuples unless the request asked for ``top_logprobs``)."""
    version: int
    """The weight version that produced these tokens."""
    finish: str | None = None
    """``None`` while the sample runs; its finish reason (``stop``, ``length``, ``abort``) on its
    last delta."""


@dataclasses.dataclass(frozen=True)
class _End:
    error: BaseException | None


class StreamTimeout(Exception):
    """No output arrived before the reader's deadline."""


class OutputStream:
    """The queue of one request (see the module's docstring): any number of :meth:`put` and then
    one :meth:`end` by the loop thread, read by one reader with :meth:`get`."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._queue: queue.SimpleQueue[SampleDelta | _End] = queue.SimpleQueue()
        self._ended = False
        self.error: BaseException | None = None
        """Why the request failed, once the reader reached the end (``None``: it did not)."""
        self.request: object = None
        """The engine's handle of the request (what ``GenerationEngine.stop_samples`` takes)."""

    def put(self, delta: SampleDelta) -> None:
        self._queue.put(delta)

    def end(self, error: BaseException | None = None) -> None:
        """No more deltas: the request is done (``error`` None) or failed. Only the first call
        counts."""
        if not self._ended:
            self._ended = True
            self._queue.put(_End(error))

    def get(self, deadline: float) -> SampleDelta | None:
        """The next delta; ``None`` at the end of a request that succeeded. Raises the request's
        error, or :class:`StreamTimeout` when nothing came by ``deadline`` (``time.monotonic``)."""
        try:
            item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise StreamTimeout() from None
        if isinstance(item, _End):
            self._queue.put(item)  # a later get sees the end again
            if item.error is not None:
                self.error = item.error
                raise item.error
            return None
        return item
