"""``python -m system.ctl``: the operator's tool for running and finished trials (``ls``,
``status``, ``cancel``, ``logs``), working from any shell with only the trial directory and the
trial's name resolution."""
