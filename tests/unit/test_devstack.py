"""The dev stack's choice of ports for its own servers."""
from __future__ import annotations

from kafscale import devstack


def test_the_dev_stack_never_picks_a_reserved_port_or_one_twice(monkeypatch):
    """The stack skips the ports its caller gave it (kafscale dev's brokers will
    listen on them), which free_port may offer, and those it picked already."""
    offered = iter([9092, 5000, 5000, 9093, 5001])
    monkeypatch.setattr(devstack, "free_port", lambda: next(offered))
    stack = devstack.DevStack(reserved={9092, 9093})
    assert [stack._pick_port(), stack._pick_port()] == [5000, 5001]


def test_free_port_never_hands_out_a_port_twice():
    """Picked one after the other, each probe socket closed before the next,
    200 kernel-chosen ports repeated one in about half of the tries here (a test
    broker once got one port for Kafka and for its admin endpoint)."""
    ports = [devstack.free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(devstack.port_is_free(p) for p in ports)
