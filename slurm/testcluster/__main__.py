"""Start or stop a private single-node Slurm (munge, slurmctld, slurmd) with fake GPUs.

    python -m slurm.testcluster start /tmp/rlslurm     # prints: export SLURM_CONF=...
    python -m slurm.testcluster stop /tmp/rlslurm
"""
from __future__ import annotations

import sys

from slurm.testcluster.cluster import SlurmTestCluster


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    cluster = SlurmTestCluster(argv[1])
    if argv[0] == "start":
        cluster.start(detach=True)
        print(f"export SLURM_CONF={cluster.conf_path}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
