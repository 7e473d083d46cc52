"""Randomized attacks on a live trial, a live OpenAI endpoint and the sbatch templates, with the
four counts the security suite reports per target (:class:`Tally`).

- :mod:`tests.fuzzing.frames`: bad ZeroMQ messages (pure generators, each with the drop
  reason a worker must count it under).
- :mod:`tests.fuzzing.trial`: a ``smoke`` trial launched with the real launcher, its workers'
  addresses and drop counters.
- :mod:`tests.fuzzing.wire`: the frame attacks, replays and connection floods against it.
- :mod:`tests.fuzzing.http`: hostile requests against an endpoint on a real vLLM engine.
- :mod:`tests.fuzzing.templates`: hostile values in every config string that reaches a script.

Used short by ``tests/integration/test_fuzz.py`` and long by ``tests/benchmarks/fuzz.py``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator

MAX_NOTES = 20


@dataclasses.dataclass
class Tally:
    """What happened to the hostile inputs sent to one target.

    ``tried`` = ``dropped_and_counted + crashed + wrongly_accepted + accepted + miscounted``:

    - dropped_and_counted: refused, and the refusal accounted for exactly (a worker's drop
      counter rose by one under the expected reason; a 4xx with a JSON error body; a
      ``ConfigError`` naming the key)
    - crashed: the target died, stopped answering legitimate calls, or raised instead of refusing
    - wrongly_accepted: an effect or an answer for something that must be refused; a counter that
      rose by less than what was sent; a template value that ran or arrived changed
    - accepted: an input that is legitimate after all (a template value delivered verbatim, an
      odd but valid HTTP request served)
    - miscounted: refused, but not accounted as it should be (wrong reason, counted twice, an
      error that does not name its key, a refusal without a JSON body)
    """

    target: str
    tried: int = 0
    dropped_and_counted: int = 0
    crashed: int = 0
    wrongly_accepted: int = 0
    accepted: int = 0
    miscounted: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)

    def note(self, text: str) -> None:
        """Keep what went wrong (the first few) for the report."""
        if len(self.notes) < MAX_NOTES:
            self.notes.append(text[:400])

    @property
    def balanced(self) -> bool:
        return self.tried == (self.dropped_and_counted + self.crashed + self.wrongly_accepted
                              + self.accepted + self.miscounted)

    @property
    def ok(self) -> bool:
        """No crash, no wrong acceptance, every drop accounted for."""
        return (self.balanced and self.crashed == 0 and self.wrongly_accepted == 0
                and self.miscounted == 0)

    def line(self) -> str:
        return (f"{self.target}: tried {self.tried}, dropped_and_counted "
                f"{self.dropped_and_counted}, crashed {self.crashed}, wrongly_accepted "
                f"{self.wrongly_accepted}, accepted {self.accepted}, miscounted "
                f"{self.miscounted}")


@dataclasses.dataclass
class Budget:
    """How long one target runs: ``count`` inputs, or ``seconds``, whichever ends first
    (``0``: no bound of that kind; at least one of them must be set)."""

    count: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.count <= 0 and self.seconds <= 0:
            raise ValueError("a budget needs a count or seconds")

    def rounds(self, tally: Tally) -> Iterator[int]:
        """Yield the inputs left to send (at least 1) until the budget is spent or the target
        crashed."""
        end = time.monotonic() + self.seconds if self.seconds > 0 else float("inf")
        while not tally.crashed and time.monotonic() < end:
            left = self.count - tally.tried if self.count > 0 else 1 << 30
            if left <= 0:
                return
            yield left


__all__ = ["Budget", "Tally"]
