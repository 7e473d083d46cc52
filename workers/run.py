"""Entry point of every worker process.

    python -m workers.run --trial-dir runs/smoke/t1 --kind rollout --index 3

The index may be omitted under a scheduler that provides it (the Slurm task id).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from system.trial import Bootstrap
from workers.kinds import KINDS, worker_class


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trial-dir", required=True)
    p.add_argument("--kind", required=True, choices=sorted(KINDS))
    p.add_argument("--index", type=int, default=None)
    args = p.parse_args(argv)
    index = args.index if args.index is not None else int(os.environ.get("RLSYS_WORKER_INDEX", 0))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {args.kind}/{index} %(levelname)s %(message)s")
    boot = Bootstrap.read(os.path.join(args.trial_dir, "bootstrap.json"))
    worker = worker_class(args.kind)(boot, index)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
