"""logs/launcher.log: the launcher's stderr unchanged, the file clean lines only."""
from __future__ import annotations

import io
import logging
import os
import re
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
        for run in ("trial=t1", "trial=t1 rl.total_steps=40"):  # two launches, one process each
            sys.stderr = term
            handler.setStream(term)
            tee_stderr(str(logs), f"python -m system.launch {run}")
            print(f"error: worker rollout/1 died in {run}", file=sys.stderr)
            logging.getLogger("t").warning("a warning")
            sys.stderr.flush()
    finally:
        logging.getLogger().removeHandler(handler)
    text = (logs / "launcher.log").read_text()
    assert "error: worker rollout/1 died in trial=t1\n" in text and "a warning\n" in text
    assert "a warning" in term.getvalue() and "===" not in term.getvalue()
    # each launch's part opens with a line saying when, where and what ran, after a blank line
    first, second = text.split("\n\n")
    assert re.fullmatch(r"=== \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} on \S+, pid \d+: "
                        r"python -m system.launch trial=t1", first.splitlines()[0])
    assert second.splitlines()[0].endswith(": python -m system.launch trial=t1 rl.total_steps=40")
    assert second.count("died in trial=t1 rl.total_steps=40") == 1
    assert "rl.total_steps" not in first


def test_no_copy_when_stderr_is_the_controller_log(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / "controller.log", "w") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            before = sys.stderr
            tee_stderr(str(logs), "python -m system.launch trial=t")
            assert isinstance(sys.stderr, LineTee) and sys.stderr.stream is before
            assert sys.stderr.log is None  # (no copy: only guarded, see the next test)
            sys.stderr = before
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert not (logs / "launcher.log").exists()


def test_a_stream_that_fails_a_write_is_written_to_no_more(tmp_path):
    """The first write that fails (a full disk, a pipe whose reader has gone) turns the stream
    off, its descriptor to /dev/null; the copy goes on and says so, and no write raises."""
    log = io.StringIO()
    with open("/dev/full", "w") as full:
        fd = full.fileno()
        tee = LineTee(full, log)
        tee.write("a line\n")
        tee.flush()  # (buffered: the flush is what fails)
        assert tee.lost is not None and "No space left on device" in tee.lost
        tee.write("another line\n")
        tee.flush()
        assert os.write(fd, b"x") == 1  # /dev/null now
    assert log.getvalue() == ("a line\n(standard error takes no more output: OSError: [Errno 28] "
                              "No space left on device; this file goes on)\nanother line\n")
    assert LineTee(None, None).write("nowhere\n") == 8  # (no stderr at all: 2>&-)
