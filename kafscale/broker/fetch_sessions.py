"""Incremental fetch sessions (KIP-227) of one protocol worker.

A consumer of many partitions names every one of them in each Fetch unless
the broker gives it a session: the first Fetch (epoch 0) names them all and
the answer carries a session id; each later Fetch (epoch 1, 2, ...) names
only the partitions whose fetch position changed or that the consumer adds
(and those it forgets), and the answer holds only the partitions with
something new: records, an error, or a high watermark or log start offset
other than the one last answered. Java's consumer, kafka-python and
@platformatic/kafka (2.3 and later) use sessions; librdkafka, Sarama and
kafkajs send session epoch -1 (no session) and get every partition back, as
before.

Sessions live in the worker that made them: a client that reconnects to
another worker of the node (SO_REUSEPORT picks one) gets
FETCH_SESSION_ID_NOT_FOUND and starts a new session, as it would after a
Kafka broker restarted. A worker keeps at most `slots` sessions; a new one
replaces the least recently used only once that has been idle for
EVICT_IDLE_S (Kafka's min.incremental.fetch.session.eviction.ms), else the
client is answered without a session (session id 0) and fetches in full.

An incremental pass does not go over every partition of its session: the
worker logs which views changed (ChangeLog), and a pass fetches the
partitions the Fetch names, those that changed since the session's last
pass and those still active (behind their high watermark, or answered with
records or an error)."""
from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any

from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.framing import FetchPartition

INVALID_SESSION_ID = 0
INITIAL_EPOCH, FINAL_EPOCH = 0, -1
EVICT_IDLE_S = 120.0

Key = str | bytes  # a topic's name, or its id from Fetch v13 on
CHANGES_KEPT = 10_000  # views' changes a worker keeps for its sessions (one further behind passes over everything)


class ChangeLog:
    """The partitions (topic name, partition) whose views changed in a worker,
    in order: an incremental Fetch looks at its session's partitions that
    changed since its last pass, not at every one."""

    def __init__(self, kept: int = CHANGES_KEPT) -> None:
        self.kept = kept
        self.start = 0  # the position of items[0]
        self.items: list[tuple[str, int]] = []

    @property
    def end(self) -> int:
        return self.start + len(self.items)

    def add(self, topic: str, partition: int) -> None:
        self.items.append((topic, partition))
        if len(self.items) > 2 * self.kept:
            del self.items[:self.kept]
            self.start += self.kept

    def since(self, position: int) -> list[tuple[str, int]] | None:
        """The changes from `position` on; None once some of them are forgotten."""
        return None if position < self.start else self.items[position - self.start:]


class FetchSession:
    __slots__ = ("active", "by_id", "epoch", "id", "names", "principal", "rank", "ranked", "seen", "sent", "topics",
                 "used")

    def __init__(self, session_id: int, principal: str, by_id: bool) -> None:
        self.id = session_id
        self.epoch = 1  # the epoch of the next Fetch
        self.principal = principal
        self.by_id = by_id  # topics named by id (Fetch v13+): a session never mixes the two
        # each topic's partitions as the Fetch that last named them asked (offset, max bytes)
        self.topics: dict[Key, dict[int, dict[str, Any]]] = {}
        self.sent: dict[tuple[Key, int], tuple[int, int]] = {}  # high watermark and log start last answered
        self.used = time.monotonic()
        # what the next incremental pass fetches besides the partitions whose views changed: those named by
        # the Fetch, answered with an error or with records, or not caught up (behind their high watermark)
        self.active: set[tuple[Key, int]] = set()
        self.seen = -1  # the worker's ChangeLog position at the last pass (-1: none yet, pass over everything)
        self.names: dict[str, Key] = {}  # topic name -> key, as the passes resolved them
        self.rank: dict[tuple[Key, int], int] = {}  # fetch order (a partition that returned records goes last)
        self.ranked = 0  # ranks given

    def key(self, topic: dict[str, Any]) -> Key:
        return topic["topic_id"] if self.by_id else topic["topic"]

    def update(self, topics: list[dict[str, Any]], forgotten: list[dict[str, Any]]) -> None:
        """Add or change the partitions a Fetch names, then drop those it forgets."""
        for t in topics:
            key = self.key(t)
            parts = self.topics.setdefault(key, {})
            for p in t["partitions"]:
                parts[p["partition"]] = p
                self.active.add(kp := (key, p["partition"]))
                if kp not in self.rank:
                    self.rank[kp] = self.ranked
                    self.ranked += 1
        for t in forgotten:
            key = self.key(t)
            parts = self.topics.get(key, {})
            for p in t["partitions"]:
                parts.pop(p, None)
                for kept in (self.sent, self.rank):
                    kept.pop((key, p), None)
                self.active.discard((key, p))
            if not parts:
                self.topics.pop(key, None)

    def due(self, changes: ChangeLog) -> list[dict[str, Any]]:
        """The partitions an incremental pass fetches, in fetch order: the
        active ones and those whose views changed since the last pass."""
        new = changes.since(self.seen)
        self.seen = changes.end
        if new is None:
            self.active.update(self.rank)
        else:
            for name, p in new:
                key = self.names.get(name)
                if key is not None and p in self.topics.get(key, ()):
                    self.active.add((key, p))
        field = "topic_id" if self.by_id else "topic"
        grouped: dict[Key, list[dict[str, Any]]] = {}
        for key, p in sorted(self.active, key=self.rank.__getitem__):
            grouped.setdefault(key, []).append(self.topics[key][p])
        return [{field: key, "partitions": parts} for key, parts in grouped.items()]

    def answered(self, topic: dict[str, Any], name: str | None, parts: list[FetchPartition], incremental: bool
                 ) -> list[FetchPartition]:
        """What of a topic's fetched partitions the answer holds (in an
        incremental one only those with something new), remembering what was
        answered and which stay active. A partition that returned records
        moves to the end of the fetch order, so that under max_bytes the
        others get their turn (as Kafka does)."""
        key = self.key(topic)
        if name is not None:
            self.names[name] = key
        sent, active, asked = self.sent, self.active, self.topics.get(key, {})
        kept = []
        for part in parts:
            p, error, hw, start, records = part
            if not incremental or error or records or sent.get((key, p)) != (hw, start):
                kept.append(part)
                if error:  # answered again once it clears, whatever its offsets then
                    sent.pop((key, p), None)
                else:
                    sent[(key, p)] = (hw, start)
            if error or records or (p in asked and asked[p]["fetch_offset"] != hw):
                active.add((key, p))
            else:
                active.discard((key, p))
            if records and (key, p) in self.rank:
                self.rank[(key, p)] = self.ranked
                self.ranked += 1
        return kept


class FetchSessions:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._sessions: OrderedDict[int, FetchSession] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def revisit(self) -> None:
        """Every session's next pass goes over all its partitions (the ACLs
        changed: a partition it may no longer read gets its error)."""
        for session in self._sessions.values():
            session.seen = -1

    def begin(self, req: dict[str, Any], principal: str, by_id: bool
              ) -> tuple[FetchSession | None, list[dict[str, Any]], bool]:
        """The session a Fetch uses (None: answered without one), the topics
        and partitions a full Fetch fetches (an incremental one asks the
        session's `due` at each pass), and whether it is incremental. A full
        Fetch (epoch 0 or -1) ends the session it names; epoch 0 asks for a
        new one. Raises KafkaError for an incremental Fetch of an unknown
        session or out of turn (the client then starts over)."""
        session_id, epoch = req.get("session_id", INVALID_SESSION_ID), req.get("session_epoch", FINAL_EPOCH)
        if epoch in (INITIAL_EPOCH, FINAL_EPOCH):
            if session_id != INVALID_SESSION_ID:
                self._sessions.pop(session_id, None)
            session = self._new(principal, by_id) if epoch == INITIAL_EPOCH else None
            if session is not None:
                session.update(req["topics"], [])
            return session, req["topics"], False
        session = self._sessions.get(session_id)
        if session is None or session.principal != principal:
            raise KafkaError(ErrorCode.FETCH_SESSION_ID_NOT_FOUND, f"no fetch session {session_id}")
        if session.by_id != by_id:
            del self._sessions[session_id]
            raise KafkaError(ErrorCode.FETCH_SESSION_TOPIC_ID_ERROR,
                             f"fetch session {session_id} was begun with topic {'ids' if by_id else 'names'}")
        if epoch != session.epoch:
            raise KafkaError(ErrorCode.INVALID_FETCH_SESSION_EPOCH,
                             f"fetch session {session_id} expects epoch {session.epoch}, not {epoch}")
        session.update(req["topics"], req.get("forgotten_topics_data") or [])
        session.epoch = 1 if session.epoch == 0x7FFFFFFF else session.epoch + 1
        session.used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return session, [], True

    def _new(self, principal: str, by_id: bool) -> FetchSession | None:
        if len(self._sessions) >= self.slots:
            oldest = next(iter(self._sessions.values()), None)
            if oldest is None or time.monotonic() - oldest.used < EVICT_IDLE_S:
                return None
            del self._sessions[oldest.id]
        session_id = INVALID_SESSION_ID
        while session_id == INVALID_SESSION_ID or session_id in self._sessions:
            session_id = secrets.randbits(31)
        session = self._sessions[session_id] = FetchSession(session_id, principal, by_id)
        return session
