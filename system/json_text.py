"""JSON that every reader parses: Python's ``json`` writes a NaN or an infinity as ``NaN`` /
``Infinity``, which is not JSON (JavaScript's ``JSON.parse``, ``jq`` and many dashboards refuse
the whole file). Records the system writes (summaries, metrics, evaluation results) go through
:func:`dumps`, which writes them as ``null``: a figure with no value (an accuracy over no
prompts, a loss that diverged)."""
from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (in dicts, lists and tuples, at any depth) as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(obj)``, refusing any NaN or infinity left (one in an
    object that ``default`` turns into a float, say) rather than writing invalid JSON."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
