"""From a recorded agent session (the turns the OpenAI endpoint saw) to trajectories.

Rules (pure; :func:`session_trajectories`):

- Turns are taken in the order their requests were made. A turn whose prompt starts with the
  whole token sequence of an open trajectory (its prompt, then everything after) extends that
  trajectory (the latest such one): the prompt's tokens beyond it (tool or environment output,
  chat-template tokens) are appended with mask 0, log-prob 0 and version -1, then the turn's
  completion with mask 1 and the log-probs, weight versions and temperature the engine
  recorded (the trainer takes its log-probs at that temperature).
- A turn whose prompt extends no open trajectory starts a new one (its prompt is the new
  trajectory's prompt). This happens when an agent edits or re-renders its history: a chat
  template that renders earlier assistant turns differently from how they were sampled (dropped
  reasoning, re-tokenised text, a changed system prompt), a text prompt whose re-tokenisation
  differs from the sampled tokens, a summarised context, or the 2nd..nth choice of a request
  with ``n`` > 1 (each choice is its own branch).
- Every trajectory of the session gets the session's reward and its index in the group
  (``session``), so GRPO normalises over sessions, not trajectories.
- A trajectory with no completion token is left out (nothing to train on).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from experiments.rl.agents import Part, _traj
from workers.schema import SessionTurn, Trajectory


@dataclasses.dataclass
class _Open:
    prompt: list[int]
    parts: list[Part]
    full: list[int]
    """Prompt and every part so far: what a later prompt must start with to extend it."""
    finish: str


def session_trajectories(turns: list[SessionTurn], reward: float, session: int
                         ) -> list[Trajectory]:
    """The trajectories of one session's turns (see the module's docstring)."""
    built: list[_Open] = []
    for turn in turns:
        prompt = [int(t) for t in turn["prompt"]]
        tokens = np.asarray(turn["tokens"], np.int32)
        policy = Part(tokens, np.asarray(turn["logprobs"], np.float32),
                      np.asarray(turn["versions"], np.int32), 1,
                      float(turn.get("temperature", 1.0)))
        into = _extended(built, prompt)
        if into is None:
            built.append(_Open(prompt, [policy], prompt + tokens.tolist(), turn["finish"]))
            continue
        gap = np.asarray(prompt[len(into.full):], np.int32)
        if len(gap):
            into.parts.append(Part(gap, np.zeros(len(gap), np.float32),
                                   np.full(len(gap), -1, np.int32), 0))
        into.parts.append(policy)
        into.full = prompt + tokens.tolist()
        into.finish = turn["finish"]
    out: list[Trajectory] = []
    for b in built:
        t = _traj(b.prompt, b.parts, b.finish)
        if (t["mask"] == 1).any():
            t["reward"] = float(reward)
            t["session"] = session
            out.append(t)
    return out


def _extended(built: list[_Open], prompt: list[int]) -> _Open | None:
    """The latest open trajectory ``prompt`` starts with, if any."""
    for b in reversed(built):
        if len(b.full) <= len(prompt) and prompt[:len(b.full)] == b.full:
            return b
    return None
