"""Verifiable rewards: ``reward(completion, answer) -> float``, 1 for right and 0 for wrong
(a plugin may return any finite number: evaluation's accuracy is then the mean reward).

- ``first_int``: the completion starts with the answer as an integer (arith-tiny).
- ``last_int``: the last integer in the completion is the answer (word problems).
- ``math``: the completion's final answer (the last ``\\boxed{...}``, else its last number)
  equals the answer as a number (``1,000`` = ``1000.0`` = ``1e3``, ``3/4`` = ``\\frac{3}{4}`` =
  ``0.75``), or, for an answer that is not a number, as text once spaces and ``$`` are dropped.

A reward plugin is any such function, declared under the ``slurm_rl.rewards`` entry-point group
(see :mod:`experiments.rl.plugins`) and chosen with ``rl.task.reward=NAME``.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable

RewardFn = Callable[[str, Any], float]
"""``(completion text, the prompt's answer) -> reward``."""

_INT = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
                     r"(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


MAX_DIGITS = 400
"""A number in a completion with more digits (or a larger exponent) than this is no answer:
Python refuses to read an integer of over 4300 digits, and ``Fraction("1e10000000")`` takes
seconds (a model can write either)."""


def integer_answer(answer: Any) -> int:
    """A prompt's answer as the integer ``first_int`` and ``last_int`` compare with: an int, a
    whole float (``3.0``) or a string of an integer (``" 3"``); ValueError for anything else
    (``2.5`` is not read as 2)."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer
    if isinstance(answer, float) and answer.is_integer():
        return int(answer)
    if isinstance(answer, str) and re.fullmatch(r"\s*[+-]?\d{1,%d}\s*" % MAX_DIGITS, answer):
        return int(answer)
    shown = repr(answer)
    raise ValueError(f"the answer {shown if len(shown) <= 60 else shown[:57] + '...'} is not an "
                     "integer")


def _same_int(digits: str, answer: Any) -> bool:
    return len(digits.lstrip("-")) <= MAX_DIGITS and int(digits) == integer_answer(answer)


def first_int_reward(completion: str, answer: Any) -> float:
    """1 if the completion starts with the answer as an integer (``"7"``, ``"7 "``), else 0."""
    m = re.match(r"\s*(-?\d+)", completion)
    return float(m is not None and _same_int(m.group(1), answer))


def last_int_reward(completion: str, answer: Any) -> float:
    """1 if the last integer in the completion is the answer, else 0."""
    found = _INT.findall(completion.replace(",", ""))
    return float(bool(found) and _same_int(found[-1], answer))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def to_number(text: str) -> Fraction | None:
    """``text`` as an exact number, or None: integers, decimals, thousands separators
    (``1,000``), exponents, ``a/b``, ``\\frac{a}{b}``, a trailing ``%`` (per cent), ``$``."""
    s = _FRAC.sub(r"(\1)/(\2)", text).replace("$", "").replace("\\!", "").replace(" ", "")
    s = s.removeprefix("\\left").rstrip(".")
    percent = s.endswith("%") or s.endswith("\\%")
    s = s.removesuffix("\\%").removesuffix("%")
    if re.fullmatch(r"-?\(?-?[\d.,]+\)?/\(?[\d.,]+\)?", s):  # a/b, (a)/(b)
        num, den = (to_number(p.strip("()")) for p in s.split("/", 1))
        value = None if num is None or not den else num / den
    elif re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?", s) and \
            re.search(r"\d", s):
        mantissa, _, exponent = s.replace(",", "").lower().partition("e")
        digits = exponent.lstrip("+-").lstrip("0") or "0"  # (1e0000000000020000000: large)
        if len(mantissa) > MAX_DIGITS or len(digits) > 4 or int(digits) > MAX_DIGITS:
            return None  # (compared as text)
        value = Fraction(s.replace(",", ""))
    else:
        return None
    return None if value is None else value / 100 if percent else value


def final_answer(completion: str) -> str | None:
    """What a completion answers: its last ``\\boxed{...}``, else its last number."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    found = _NUMBER.findall(completion)
    return found[-1] if found else None


def _text(s: str) -> str:
    return re.sub(r"\s+|\$|\\[,;!]|\\left|\\right", "", s).rstrip(".")


def math_reward(completion: str, answer: Any) -> float:
    """1 if the completion's final answer equals ``answer`` (as a number when both are
    numbers, else as text), else 0."""
    got = final_answer(completion)
    if got is None:
        return 0.0
    want = str(answer)
    a, b = to_number(got), to_number(want)
    if a is not None and b is not None:
        return float(a == b)
    return float(_text(got) == _text(want) and _text(want) != "")


REWARDS: dict[str, RewardFn] = {
    "first_int": first_int_reward,
    "last_int": last_int_reward,
    "math": math_reward,
}
"""The built-in rewards, by the name ``rl.task.reward`` takes."""

ANSWER_CHECKS: dict[RewardFn, Callable[[Any], Any]] = {
    first_int_reward: integer_answer, last_int_reward: integer_answer}
"""What a reward needs of every prompt's answer: checked when the prompts are loaded (raises
ValueError saying why), not once a completion happens to start with a digit mid-run."""
