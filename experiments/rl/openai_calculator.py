"""The calculator agent written against the OpenAI API (``rl.agent.kind=openai
rl.agent.function=calculator``): what :class:`~experiments.rl.agents.CalculatorAgent` does, as
an ordinary agent function that only sees an OpenAI client.

The model may call the calculator by writing ``[expr]``: each turn is a completion that stops at
``]``; the function evaluates ``expr`` and appends ``]`` and the value to the text, and asks
again, up to :data:`MAX_TURNS` turns and :data:`MAX_NEW_TOKENS` sampled tokens. The reward is
the task's (arith: the answer first) on the last turn's text, the answer after the last tool
output.

Prompts are text: the endpoint tokenises them. That re-tokenisation must give back the tokens
the model sampled, or a later turn would not extend the earlier one and the session would
split into several trajectories (:mod:`experiments.rl.sessions`). With arith-tiny's character
tokenizer it does (one character, one token; ``tests/experiments/rl/test_openai_agent.py``
checks it). For a subword tokenizer, send ``prompt`` as token ids instead (the OpenAI API
takes a list of ints; the endpoint returns each choice's ``logprobs.token_ids``).
"""
from __future__ import annotations

from typing import Any

from experiments.rl.agents import calculate
from experiments.rl.rewards import first_int_reward

MAX_NEW_TOKENS = 16
"""Sampled tokens per session, over all turns."""
MAX_TURNS = 4
"""Completion requests per session."""
TEMPERATURE = 1.0


async def run(client: Any, task: dict[str, Any]) -> float:
    """One episode of ``task`` (``{"id", "prompt", "answer"}``) through ``client`` (an
    ``openai.AsyncOpenAI``); returns its reward."""
    text, last, used = "", "", 0
    for _ in range(MAX_TURNS):
        if used >= MAX_NEW_TOKENS:
            break
        out = await client.completions.create(
            model="policy", prompt=task["prompt"] + text, max_tokens=MAX_NEW_TOKENS - used,
            temperature=TEMPERATURE, stop=["]"], logprobs=0)
        choice = out.choices[0]
        used += out.usage.completion_tokens
        text += choice.text
        last = choice.text
        # a tool call ends at "]": the stop string (not returned in text), the last token
        if choice.finish_reason != "stop" or choice.logprobs.tokens[-1:] != ["]"]:
            break
        call = last[last.rfind("[") + 1:] if "[" in last else ""
        value = calculate(call) if call else None
        text += "]" + ("?" if value is None else str(value))
        last = ""
    return first_int_reward(last, task["answer"])
