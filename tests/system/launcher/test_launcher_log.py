"""logs/launcher.log: the launcher's stderr unchanged, the file clean lines only."""
from __future__ import annotations

import io
import logging
import os
import sys

from system.launcher.launcher_log import LineTee, tee_stderr


def test_lines_without_control_codes_and_redraws():
    term, log = io.StringIO(), io.StringIO()
    tee = LineTee(term, log)
    parts = ["\x1b[?25l", "\r\x1b[2Ksmoke/t | registered 3/9", "\r\x1b[2Ksmoke/t | registered 9/9",
             "\r\x1b[2K\x1b[1mrecovering\x1b[0m: restarting rollout/1\n",
             "\r\x1b[2Ksmoke/t | step 4/10", "\r\x1b[2Ksmoke/t | step 5/10\n", "half a ", "line"]
    for p in parts:
        tee.write(p)
    assert term.getvalue() == "".join(parts)  # the terminal sees everything, as before
    assert log.getvalue() == "recovering: restarting rollout/1\nsmoke/t | step 5/10\n"
    tee.write(" ends\n")
    assert log.getvalue().splitlines()[-1] == "half a line ends"


def test_tee_stderr_copies_prints_and_logging(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    handler = logging.StreamHandler(term)
    logging.getLogger().addHandler(handler)
    try:
        tee_stderr(str(logs))
        print("error: worker rollout/1 died", file=sys.stderr)
        logging.getLogger("t").warning("a warning")
        sys.stderr.flush()
    finally:
        logging.getLogger().removeHandler(handler)
    text = (logs / "launcher.log").read_text()
    assert "error: worker rollout/1 died\n" in text and "a warning\n" in text
    assert "a warning" in term.getvalue()


def test_no_copy_when_stderr_is_the_controller_log(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / "controller.log", "w") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            before = sys.stderr
            tee_stderr(str(logs))
            assert sys.stderr is before
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert not (logs / "launcher.log").exists()
