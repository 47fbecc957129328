"""The dev stack's choice of ports for its own servers."""
from __future__ import annotations

from kafscale import devstack


def test_the_dev_stack_never_picks_a_reserved_port_or_one_twice(monkeypatch):
    """free_port may hand out a port again once its probe socket closed: the
    stack skips the ports kafscale dev's brokers will listen on, and those it
    picked already."""
    offered = iter([9092, 5000, 5000, 9093, 5001])
    monkeypatch.setattr(devstack, "free_port", lambda: next(offered))
    stack = devstack.DevStack(reserved={9092, 9093})
    assert [stack._pick_port(), stack._pick_port()] == [5000, 5001]


def test_free_ports_are_distinct():
    """Ports asked for together are all different: 200 picked one after the
    other, each probe socket closed before the next, repeated a port in about
    half of the tries here (a test broker once got one port for Kafka and for
    its admin endpoint)."""
    ports = devstack.free_ports(200)
    assert len(set(ports)) == 200
    assert all(devstack.port_is_free(p) for p in ports)
