"""The parts of ``make gpu-check`` (issue 13), each a module runnable on its own with
``python3 -m scripts.gpu_checks.<part> [--device cuda|cpu]`` and the driver that runs them all,
``python3 -m scripts.gpu_checks``. See :mod:`scripts.gpu_checks.__main__`."""
