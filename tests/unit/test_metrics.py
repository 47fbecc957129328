"""metrics.Tally: increments held in memory reach the counter at the latest
at the next flush, and none is lost or counted twice."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter

from kafscale import metrics


def test_a_tally_holds_increments_until_due_and_loses_none(monkeypatch) -> None:
    monkeypatch.setattr(metrics, "_tally_s", 0.1)
    registry = CollectorRegistry()
    tally = metrics.Tally(Counter("t", "t", registry=registry))

    def counted() -> float | None:
        return registry.get_sample_value("t_total")

    tally.inc(3)  # the first one is due at once
    assert counted() == 3
    for _ in range(5):
        tally.inc(2)
    assert counted() == 3, "held until due"
    metrics.flush_tallies()
    assert counted() == 13
    tally.inc()
    time.sleep(0.11)
    tally.inc()  # due: both reach the counter
    assert counted() == 15


def test_without_multiprocess_mode_a_tally_counts_at_once() -> None:
    registry = CollectorRegistry()
    tally = metrics.Tally(Counter("u", "u", registry=registry))
    for _ in range(3):
        tally.inc()
    assert registry.get_sample_value("u_total") == 3
