"""When an agent function's failures stop being worth retrying (``rl.agent.kind=openai``).

A group whose agent function raised, returned no finite number, made no request or ran past
``rl.call_timeout`` fails; the master hands its prompt out again, since such a failure may pass
(a tool service that timed out, say). A function that fails the same way every time would be
retried for ever, though: :class:`AgentFailures` is the rule that ends it. A prompt whose group
failed :data:`PROMPT_TRIES` times in the agent function is skipped (like a prompt the servers
refuse), and once :func:`run_limit` groups in a row failed there, none accepted in between, the
function is taken as broken and the trial stops, naming its last error.

Failures of the servers or the network around the function (a server died, a session could
not be fetched) are not counted here: recovery handles them.
"""
from __future__ import annotations

from collections import Counter
from typing import Literal

PROMPT_TRIES = 3
"""Agent-function failures of one prompt's group after which the prompt is skipped."""

Verdict = Literal["retry", "skip", "stop"]


def run_limit(batch_size: int) -> int:
    """Groups failing in a row, in the agent function, that stop the trial: three steps' worth,
    at least 24 (a function failing half the time does that about once in 2^24 runs)."""
    return max(24, 3 * batch_size)


class AgentFailures:
    """Counts, per prompt and in a row, the groups that failed in the agent function."""

    def __init__(self, batch_size: int) -> None:
        self.limit = run_limit(batch_size)
        self.per_prompt: Counter[int] = Counter()
        self.in_a_row = 0

    def failed(self, prompt_id: int) -> Verdict:
        """One more group of ``prompt_id`` failed in the agent function: hand the prompt out
        again, skip it, or stop the trial."""
        self.per_prompt[prompt_id] += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            return "stop"
        return "skip" if self.per_prompt[prompt_id] >= PROMPT_TRIES else "retry"

    def accepted(self, prompt_id: int) -> None:
        """A group of ``prompt_id`` was accepted: the function works (the run ends)."""
        self.in_a_row = 0
        self.per_prompt.pop(prompt_id, None)
