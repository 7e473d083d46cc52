"""Install the example task plugin (examples/task_plugin) the way a user would, with pip, into a
directory of its own: put that directory on ``sys.path`` / ``PYTHONPATH`` and its entry points
(``slurm_rl.tasks: paren``, ``slurm_rl.rewards: exact``) are declared."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.helpers import REPO


def install_example_plugin(tmp: str) -> str:
    """The site directory the plugin was installed into (its source is copied first: a build
    writes next to the sources)."""
    src, site = os.path.join(tmp, "src"), os.path.join(tmp, "site")
    shutil.copytree(os.path.join(REPO, "examples", "task_plugin"), src)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", site, src],
                   check=True, capture_output=True, timeout=120)
    return site
