"""When a worker judges its controller dead, from the reads of its liveness key (the pure
clock; ``test_orphan.py`` runs real workers)."""
from __future__ import annotations

from workers.orphan_clock import OrphanClock


def test_a_key_gone_for_the_orphan_timeout_ends_it():
    c = OrphanClock(10.0, 30.0, now=0.0)
    assert c.read(1.0, True) is None and c.read(11.0, False) is None  # gone 10s: not yet
    why = c.read(11.5, False)
    assert why == "the controller's liveness key has been gone for 10s (orphan_timeout=10s)"
    assert c.read(12.0, True) is None  # (back: seen again)


def test_a_key_that_never_appears_ends_it_after_the_orphan_timeout_from_the_start():
    c = OrphanClock(10.0, 30.0, now=100.0)
    assert c.read(105.0, False) is None
    assert c.read(110.5, False) == ("the controller's liveness key has not appeared since this "
                                    "worker started, 10s (orphan_timeout=10s)")


def test_a_name_service_that_does_not_answer_ends_it_only_past_its_outage_budget():
    """Each unanswered read restarted the clock: with the name service down for good (and the
    controller with it) the workers ran on for ever."""
    c = OrphanClock(10.0, 30.0, now=0.0)
    assert c.read(1.0, True) is None
    for t in (5.0, 20.0, 35.0, 41.0):  # within 10 + 30 s of the last sight
        assert c.read(t, None) is None
    assert c.read(41.5, None) == (
        "the name service has not answered for 36s and the controller's liveness key was last "
        "seen 40s ago (orphan_timeout=10s, plus 30s for the name service to come back)")


def test_a_name_service_back_from_an_outage_restarts_the_clock():
    """It may have lost every key: the controller's comes back within its refresh."""
    c = OrphanClock(10.0, 30.0, now=0.0)
    assert c.read(1.0, True) is None
    assert c.read(30.0, None) is None
    assert c.read(35.0, False) is None  # answers again, without the key: counted from now
    assert c.read(44.0, False) is None
    assert c.read(45.5, False) == ("the controller's liveness key has been gone for 10s "
                                   "(orphan_timeout=10s)")
    never = OrphanClock(10.0, 0.0, now=0.0)  # (a file backend: no outage budget)
    assert never.read(5.0, None) is None and never.read(8.0, False) is None
    assert never.read(18.5, False).startswith("the controller's liveness key has not appeared")
    assert OrphanClock(10.0, 0.0, now=0.0).read(10.5, None).startswith(
        "the name service has not answered for 0s and the controller's liveness key was not "
        "seen since this worker started, 10s ago")
