"""The live brokers as this broker sees them, and who should own what.

Partitions and consumer groups are placed on live brokers by rendezvous
(highest random weight) hashing: every broker computes the same answer from
the same membership, and when a broker joins or leaves only the keys it
gains or loses move."""
from __future__ import annotations

import xxhash

from kafscale.config import Config
from kafscale.metadata.store import MetaStore


def rendezvous(key: str, ids: list[int]) -> int | None:
    return max(ids, key=lambda b: xxhash.xxh64_intdigest(f"{key}|{b}".encode())) if ids else None


class Cluster:
    def __init__(self, meta: MetaStore, cfg: Config, member: bool = True) -> None:
        """member: this process is one of the brokers (the proxy is not)."""
        self.meta = meta
        self.me = cfg.node_id if member else -1
        self._own = (self.me, cfg.advertised_addr()) if member else None
        self.brokers: dict[int, tuple[str, int]] = dict([self._own]) if self._own else {}

    async def refresh(self) -> None:
        """Live brokers that take work: registered and not being drained."""
        draining = await self.meta.draining()
        live = {b: (h, p) for b, h, p in await self.meta.list_brokers() if b not in draining}
        if self._own and self.me not in draining:
            live.setdefault(*self._own)  # we are alive even if etcd has not caught up
        self.brokers = live

    def desired_owner(self, topic: str, partition: int) -> int:
        found = rendezvous(f"p|{topic}|{partition}", sorted(self.brokers))
        return self.me if found is None else found

    def leader(self, topic: str, partition: int, recorded: int | None) -> int:
        """Who serves a partition: its recorded owner while that broker is live,
        else the broker that will claim it on first use."""
        return recorded if recorded in self.brokers else self.desired_owner(topic, partition)

    def coordinator_for(self, group: str) -> int:
        found = rendezvous(f"g|{group}", sorted(self.brokers))
        return self.me if found is None else found

    def collects(self) -> bool:
        """Whether this broker collects the cluster's forgotten node objects."""
        return rendezvous("collector", sorted(self.brokers)) in (self.me, None)

    def address(self, broker_id: int) -> tuple[str, int]:
        return self.brokers.get(broker_id) or self.brokers[self.me]
