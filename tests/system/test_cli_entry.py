"""What an entry point does before its imports (system/cli_entry.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import REPO


def test_a_closed_standard_descriptor_is_opened_on_dev_null(tmp_path):
    """Started with ``2>&-``, the first file opened took descriptor 2: what went to standard
    error (the launcher's dump of its stacks) was written into it (the trial's lock)."""
    code = textwrap.dedent(f"""
        import os
        from system.cli_entry import std_fds_open
        std_fds_open()
        with open({str(tmp_path / "lock")!r}, "w") as f:
            print(f.fileno(), os.readlink("/proc/self/fd/2"), flush=True)
            os.write(2, b"stacks")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                       text=True, stderr=subprocess.DEVNULL,
                       preexec_fn=lambda: __import__("os").close(2), timeout=60)
    fileno, fd2 = r.stdout.split()
    assert int(fileno) > 2 and fd2 == "/dev/null", r.stdout
    assert (tmp_path / "lock").read_text() == ""
