"""``first_line``: every error the system names in one line goes through it."""
from __future__ import annotations

import pytest

from system.errors import WorkerFailure, first_line


@pytest.mark.parametrize("error, line", [
    (ValueError("bad value\n  at line 3\n"), "bad value"),
    (ValueError("\n  indented first line  \nsecond"), "indented first line"),
    (ValueError(), ""),                      # no message: empty, never an IndexError
    (ValueError("   \n  "), ""),
    (WorkerFailure("model/0 died\nthen master/0 failed", "model/0", None), "model/0 died"),
    ("plain text\nmore", "plain text"),
    ("", ""),
])
def test_first_line_names_an_error_in_one_line(error, line):
    assert first_line(error) == line
