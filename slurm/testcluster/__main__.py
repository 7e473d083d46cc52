"""Start or stop a private Slurm (munge, slurmctld, one slurmd per node) with fake GPUs.

    python -m slurm.testcluster start /tmp/rlslurm            # prints: export SLURM_CONF=...
    python -m slurm.testcluster start /tmp/rlslurm2 --nodes 2 # nodes rlnode0, rlnode1
    python -m slurm.testcluster stop /tmp/rlslurm [--nodes 2]
"""
from __future__ import annotations

import argparse
import sys

from slurm.testcluster.cluster import SlurmTestCluster


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("start", "stop"))
    p.add_argument("root")
    p.add_argument("--nodes", type=int, default=1, help="nodes, one slurmd each (default 1)")
    p.add_argument("--gpus", type=int, default=4, help="fake GPUs per node (default 4)")
    args = p.parse_args(argv)
    cluster = SlurmTestCluster(args.root, gpus=args.gpus, nodes=args.nodes)
    if args.action == "start":
        cluster.start(detach=True)
        if not cluster.char_gpus:
            print("note: mknod was refused; the fake GPUs are plain files and jobs see no "
                  "CUDA_VISIBLE_DEVICES", file=sys.stderr)
        print(f"export SLURM_CONF={cluster.conf_path}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
