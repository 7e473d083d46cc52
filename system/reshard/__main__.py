"""``python -m system.reshard check ...``: see :mod:`system.reshard.check`."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from system.reshard.check import main  # noqa: E402

sys.exit(main())
