"""metrics.Tally and HistogramTally: increments and observations held in
memory reach the metric at the latest at the next flush, and none is lost or
counted twice."""
from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

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


def test_a_histogram_tally_shows_what_observing_each_value_shows(monkeypatch) -> None:
    monkeypatch.setattr(metrics, "_tally_s", 0.1)
    held, plain = CollectorRegistry(), CollectorRegistry()
    buckets = (.001, .01, .1, 1)
    tally = metrics.HistogramTally(Histogram("h", "h", ["api"], buckets=buckets, registry=held).labels("x"))
    direct = Histogram("h", "h", ["api"], buckets=buckets, registry=plain).labels("x")
    values = [0.0005, 0.001, 0.0011, 0.05, 0.1, 0.5, 2, 7, 0]
    tally.observe(values[0])  # the first one is due at once
    direct.observe(values[0])
    for v in values[1:]:
        tally.observe(v)
        direct.observe(v)
    assert held.get_sample_value("h_count", {"api": "x"}) == 1, "held until due"
    metrics.flush_tallies()
    assert samples(held) == pytest.approx(samples(plain))
    metrics.flush_tallies()  # nothing held: nothing counted twice
    assert samples(held) == pytest.approx(samples(plain))


def samples(registry: CollectorRegistry) -> dict[str, float]:
    return {f"{s.name}{s.labels}": s.value for m in registry.collect() for s in m.samples
            if not s.name.endswith("_created")}
