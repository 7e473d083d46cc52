"""A TensorBoard scalar writer on the ``tensorboard`` package alone: the master logs its metrics
without importing torch (``torch.utils.tensorboard`` costs 1.8 CPU-s of its start on two cores
for what is a protobuf appended to a file). It writes the events ``SummaryWriter`` writes, with
its ``purge_step`` (a resumed run hides the later events of the run it redoes)."""
from __future__ import annotations

import time

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class ScalarWriter:
    """Scalars into a new event file in ``logdir``; ``purge_step``: events of that step and
    later from earlier files are discarded by readers (a ``SessionLog.START`` at that step)."""

    def __init__(self, logdir: str, purge_step: int | None = None) -> None:
        self._events = EventFileWriter(logdir)
        if purge_step is not None:
            self._events.add_event(Event(step=purge_step, wall_time=time.time(),
                                         session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._events.add_event(Event(summary=summary, step=step, wall_time=time.time()))

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        self._events.close()


__all__ = ["ScalarWriter"]
