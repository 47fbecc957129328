"""Classic consumer-group coordinator (JoinGroup / SyncGroup / Heartbeat /
LeaveGroup, offsets), with group state and offsets kept in etcd.

States follow Kafka's: Empty -> PreparingRebalance -> CompletingRebalance ->
Stable, back to PreparingRebalance when membership changes. The broker is
agnostic of the assignment strategy (range, roundrobin, cooperative-sticky):
it picks the protocol every member supports and hands the leader's
assignments out, as Kafka does.

After every completed rebalance the group (generation, leader, members and
their assignments) is written to etcd, so a restarted broker recognises the
members' next heartbeats and the group carries on without a rebalance."""
from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kafscale.client import decode_subscription
from kafscale.metadata.store import MetaStore
from kafscale.protocol.errors import ErrorCode, KafkaError
from kafscale.protocol.types import TopicPartition

log = logging.getLogger(__name__)

EMPTY, PREPARING, COMPLETING, STABLE, DEAD = "Empty", "PreparingRebalance", "CompletingRebalance", "Stable", "Dead"
MIN_SESSION_MS, MAX_SESSION_MS = 1000, 1_800_000
MAX_OFFSET_METADATA = 4096


class GroupError(KafkaError):
    """A group-protocol error (unknown member, illegal generation, ...)."""


@dataclass
class Member:
    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocol_type: str
    protocols: list[tuple[str, bytes]]
    assignment: bytes = b""
    last_heartbeat: float = field(default_factory=time.monotonic)
    join_future: asyncio.Future[dict[str, Any]] | None = None
    sync_future: asyncio.Future[dict[str, Any]] | None = None

    def metadata(self, protocol: str | None) -> bytes:
        return next((m for n, m in self.protocols if n == protocol), b"")

    def to_json(self) -> dict[str, Any]:
        return {"member_id": self.member_id, "group_instance_id": self.group_instance_id,
                "client_id": self.client_id, "client_host": self.client_host,
                "session_timeout_ms": self.session_timeout_ms, "rebalance_timeout_ms": self.rebalance_timeout_ms,
                "protocol_type": self.protocol_type,
                "protocols": [[n, base64.b64encode(m).decode()] for n, m in self.protocols],
                "assignment": base64.b64encode(self.assignment).decode()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Member:
        return cls(d["member_id"], d["group_instance_id"], d["client_id"], d["client_host"],
                   d["session_timeout_ms"], d["rebalance_timeout_ms"], d["protocol_type"],
                   [(n, base64.b64decode(m)) for n, m in d["protocols"]], base64.b64decode(d["assignment"]))


@dataclass
class Group:
    group_id: str
    state: str = EMPTY
    generation: int = 0
    protocol_type: str | None = None
    protocol: str | None = None
    leader: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)  # member ids handed out (MEMBER_ID_REQUIRED)
    rebalance_task: asyncio.Task[None] | None = None
    persister: asyncio.Task[None] | None = None  # writes the group's state to etcd until it is there
    dirty: bool = False  # state changed since the persister last wrote it
    join_earliest: float = 0.0  # a rebalance completes no sooner (initial delay of an empty group)
    join_deadline: float = 0.0  # members that have not rejoined by then are dropped
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def static_member(self, instance_id: str) -> Member | None:
        return next((m for m in self.members.values() if m.group_instance_id == instance_id), None)

    def to_json(self) -> dict[str, Any]:
        return {"state": STABLE if self.members else EMPTY, "generation": self.generation,
                "protocol_type": self.protocol_type, "protocol": self.protocol, "leader": self.leader,
                "members": [m.to_json() for m in self.members.values()]}


class GroupCoordinator:
    def __init__(self, meta: MetaStore, initial_rebalance_delay_ms: int = 500,
                 lease_valid: Callable[[], bool] = lambda: True) -> None:
        self.meta = meta
        self.initial_delay = initial_rebalance_delay_ms / 1000
        self.groups: dict[str, Group] = {}
        self._expiry: asyncio.Task[None] | None = None
        # Whether this broker's etcd lease is surely still alive. A coordinator
        # that was paused past it may already have a successor: until the lease
        # is known good again (or lost, which evicts every group), its timers
        # change nothing: no member expires, no rebalance completes.
        self.lease_valid = lease_valid
        # Offsets committed to a group while its etcd write is under way: written
        # together next (the later of two for a partition winning), and the future
        # their commits wait on.
        self._queued: dict[str, tuple[dict[TopicPartition, dict[str, Any]], asyncio.Future[None]]] = {}
        self._writers: dict[str, asyncio.Task[None]] = {}
        self._loading: dict[str, asyncio.Future[dict[str, Any] | None]] = {}  # groups being read from etcd

    async def start(self) -> None:
        self._expiry = asyncio.create_task(self._expire_loop(), name="group session expiry")

    async def close(self) -> None:
        if self._expiry:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        for g in self.groups.values():
            if g.rebalance_task:
                g.rebalance_task.cancel()
        writing = [g.persister for g in self.groups.values() if g.persister is not None and not g.persister.done()]
        writing += self._writers.values()
        if writing:  # the next coordinator loads what is in etcd
            await asyncio.wait(writing, timeout=2)
            for t in writing:
                t.cancel()

    async def _group(self, gid: str, create: bool = False) -> Group | None:
        """The group, loaded from etcd the first time this broker coordinates it
        (after a restart, or when it moved here from another broker)."""
        g = self.groups.get(gid)
        if g is None:
            loading = self._loading.get(gid)
            if loading is None:  # one read for the requests that ask at once (a run of pipelined commits)
                loading = self._loading[gid] = asyncio.ensure_future(self.meta.load_group(gid))
                loading.add_done_callback(lambda _: self._loading.pop(gid, None))
            d = await asyncio.shield(loading)
            if d is not None:
                g = Group(gid, generation=d["generation"], protocol_type=d["protocol_type"], protocol=d["protocol"],
                          leader=d["leader"])
                g.members = {m["member_id"]: Member.from_json(m) for m in d["members"]}
                g.state = STABLE if g.members else EMPTY
                g = self.groups.setdefault(gid, g)
            elif create:
                g = self.groups.setdefault(gid, Group(gid))
        return g

    async def evict(self, unwanted: Callable[[str], bool]) -> None:
        """Forget groups this broker no longer coordinates (their state is in etcd)."""
        for gid in [gid for gid in self.groups if unwanted(gid)]:
            g = self.groups.pop(gid)
            if g.rebalance_task:
                g.rebalance_task.cancel()
            for m in g.members.values():
                for fut in (m.join_future, m.sync_future):
                    if fut is not None and not fut.done():
                        fut.set_exception(GroupError(ErrorCode.NOT_COORDINATOR))

    # ------------------------------------------------------------------ join
    async def join(self, req: dict[str, Any], version: int, client_id: str, client_host: str) -> dict[str, Any]:
        gid = req["group_id"]
        if not gid:
            raise GroupError(ErrorCode.INVALID_GROUP_ID, "group id is empty")
        if not MIN_SESSION_MS <= req["session_timeout_ms"] <= MAX_SESSION_MS:
            raise GroupError(ErrorCode.INVALID_SESSION_TIMEOUT)
        g = await self._group(gid, create=True)
        assert g is not None
        protocols = [(p["name"], bytes(p["metadata"])) for p in req["protocols"]]
        async with g.lock:
            if g.members and (req["protocol_type"] != g.protocol_type or not self._supported_by_all(g, protocols)):
                raise GroupError(ErrorCode.INCONSISTENT_GROUP_PROTOCOL)
            member_id = req["member_id"]
            instance = req.get("group_instance_id")
            rebalance_ms = req.get("rebalance_timeout_ms", -1)
            if rebalance_ms < 0:
                rebalance_ms = req["session_timeout_ms"]
            if not member_id:
                member_id = f"{client_id or 'member'}-{uuid.uuid4()}"
                if instance is not None:
                    old = g.static_member(instance)
                    if old is not None:
                        return self._replace_static(g, old, member_id, protocols)
                elif version >= 4:  # KIP-394: the client must rejoin with this id
                    g.pending[member_id] = time.monotonic() + req["session_timeout_ms"] / 1000
                    return self._join_response(g, ErrorCode.MEMBER_ID_REQUIRED, member_id)
            elif member_id not in g.members and g.pending.pop(member_id, None) is None:
                raise GroupError(ErrorCode.UNKNOWN_MEMBER_ID, f"unknown member {member_id}")
            m = g.members.get(member_id)
            if m is not None and m.protocols == protocols and (
                    g.state == COMPLETING or (g.state == STABLE and member_id != g.leader)):
                m.last_heartbeat = time.monotonic()  # rejoining unchanged: nothing to rebalance
                return self._member_join_response(g, m)
            if m is None:
                m = Member(member_id, instance, client_id, client_host, req["session_timeout_ms"], rebalance_ms,
                           req["protocol_type"], protocols)
                g.members[member_id] = m
                log.info("group %s: member %s joined", gid, member_id)
            else:
                m.protocols, m.session_timeout_ms, m.rebalance_timeout_ms = protocols, req["session_timeout_ms"], \
                    rebalance_ms
            if g.protocol_type is None or not g.members or len(g.members) == 1:
                g.protocol_type = req["protocol_type"]
            m.last_heartbeat = time.monotonic()
            if m.join_future is not None and not m.join_future.done():  # superseded by this join
                m.join_future.set_exception(GroupError(ErrorCode.REBALANCE_IN_PROGRESS))
            m.join_future = asyncio.get_running_loop().create_future()
            fut = m.join_future
            self._prepare_rebalance(g, f"member {member_id} joined")
            self._maybe_complete_join(g)
        return await fut

    def _supported_by_all(self, g: Group, protocols: list[tuple[str, bytes]]) -> bool:
        names = {n for n, _ in protocols}
        return all(names & {n for n, _ in m.protocols} for m in g.members.values())

    def _replace_static(self, g: Group, old: Member, new_id: str, protocols: list[tuple[str, bytes]]
                        ) -> dict[str, Any]:
        """A static member came back (new member id, same instance id): it keeps
        its assignment; the old id is fenced. No rebalance unless it led."""
        old_id = old.member_id
        del g.members[old_id]
        for fut in (old.join_future, old.sync_future):
            if fut is not None and not fut.done():
                fut.set_exception(GroupError(ErrorCode.FENCED_INSTANCE_ID))
        old.member_id, old.protocols, old.last_heartbeat = new_id, protocols, time.monotonic()
        old.join_future = old.sync_future = None
        g.members[new_id] = old
        if g.leader == old_id:
            g.leader = new_id
        log.info("group %s: static member %s rejoined as %s", g.group_id, old.group_instance_id, new_id)
        return self._member_join_response(g, old)

    def _member_join_response(self, g: Group, m: Member) -> dict[str, Any]:
        resp = self._join_response(g, ErrorCode.NONE, m.member_id)
        if m.member_id == g.leader:
            resp["members"] = [{"member_id": x.member_id, "group_instance_id": x.group_instance_id,
                                "metadata": x.metadata(g.protocol)} for x in g.members.values()]
        return resp

    @staticmethod
    def _join_response(g: Group, code: ErrorCode, member_id: str) -> dict[str, Any]:
        return {"throttle_time_ms": 0, "error_code": code, "generation_id": g.generation if code == 0 else -1,
                "protocol_type": g.protocol_type, "protocol_name": g.protocol if code == 0 else None,
                "leader": g.leader or "", "skip_assignment": False, "member_id": member_id, "members": []}

    def _prepare_rebalance(self, g: Group, reason: str) -> None:
        if g.state == PREPARING:
            return
        for m in g.members.values():  # members waiting in SyncGroup must rejoin
            if m.sync_future is not None and not m.sync_future.done():
                m.sync_future.set_exception(GroupError(ErrorCode.REBALANCE_IN_PROGRESS))
        now = time.monotonic()
        g.join_earliest = now + (self.initial_delay if g.state == EMPTY else 0)
        g.join_deadline = max(now + max((m.rebalance_timeout_ms for m in g.members.values()), default=0) / 1000,
                              g.join_earliest)
        g.state = PREPARING
        log.info("group %s: preparing rebalance (%s)", g.group_id, reason)
        if g.rebalance_task:
            g.rebalance_task.cancel()
        g.rebalance_task = asyncio.create_task(self._rebalance_timer(g))

    async def _rebalance_timer(self, g: Group) -> None:
        await asyncio.sleep(max(g.join_earliest - time.monotonic(), 0))
        async with g.lock:
            if self._maybe_complete_join(g) or g.state != PREPARING:
                return
        await asyncio.sleep(max(g.join_deadline - time.monotonic(), 0))
        while not self.lease_valid():  # noqa: ASYNC110 - a clock deadline, not an event: checked at each tick
            await asyncio.sleep(0.25)
        async with g.lock:
            if g.state != PREPARING:
                return
            for mid in [mid for mid, m in g.members.items() if m.join_future is None]:
                log.info("group %s: member %s did not rejoin in time", g.group_id, mid)
                del g.members[mid]
            self._complete_join(g)

    def _maybe_complete_join(self, g: Group) -> bool:
        """Complete the join once every member has rejoined (and the initial delay passed)."""
        if g.state != PREPARING or time.monotonic() < g.join_earliest:
            return False
        if any(m.join_future is None for m in g.members.values()):
            return False
        self._complete_join(g)
        return True

    def _complete_join(self, g: Group) -> None:
        if g.rebalance_task is not None and g.rebalance_task is not asyncio.current_task():
            g.rebalance_task.cancel()
        g.rebalance_task = None
        g.generation += 1
        if not g.members:
            g.state, g.protocol, g.leader = EMPTY, None, None
            self._persist_later(g)
            return
        g.protocol = self._select_protocol(g)
        if g.leader not in g.members:
            g.leader = next(iter(g.members))
        g.state = COMPLETING
        log.info("group %s: generation %d with %d members, protocol %s, leader %s", g.group_id, g.generation,
                 len(g.members), g.protocol, g.leader)
        for m in g.members.values():
            fut, m.join_future = m.join_future, None
            if fut is not None and not fut.done():
                fut.set_result(self._member_join_response(g, m))

    @staticmethod
    def _select_protocol(g: Group) -> str:
        candidates = set.intersection(*({n for n, _ in m.protocols} for m in g.members.values()))
        votes = Counter(next(n for n, _ in m.protocols if n in candidates) for m in g.members.values())
        return max(sorted(candidates), key=lambda n: votes[n])

    # ------------------------------------------------------------------ sync
    async def sync(self, req: dict[str, Any]) -> dict[str, Any]:
        g = await self._group(req["group_id"])
        if g is None:
            raise GroupError(ErrorCode.UNKNOWN_MEMBER_ID)
        async with g.lock:
            m = self._check_member(g, req["member_id"], req["generation_id"], req.get("group_instance_id"))
            if g.state == PREPARING:
                raise GroupError(ErrorCode.REBALANCE_IN_PROGRESS)
            m.last_heartbeat = time.monotonic()
            if g.state == STABLE:
                return self._sync_response(g, m)
            fut = m.sync_future = asyncio.get_running_loop().create_future()
            if m.member_id == g.leader:
                given = {a["member_id"]: bytes(a["assignment"]) for a in req["assignments"]}
                for x in g.members.values():
                    x.assignment = given.get(x.member_id, b"")
                if not await self._save(g):  # members must not run an assignment a new coordinator lacks
                    for x in g.members.values():
                        if x.sync_future is not None and not x.sync_future.done() and x is not m:
                            x.sync_future.set_exception(GroupError(ErrorCode.COORDINATOR_NOT_AVAILABLE))
                        x.sync_future = None
                    self._prepare_rebalance(g, "its state could not be saved")
                    raise GroupError(ErrorCode.COORDINATOR_NOT_AVAILABLE)
                g.state = STABLE
                for x in g.members.values():
                    if x.sync_future is not None and not x.sync_future.done():
                        x.sync_future.set_result(self._sync_response(g, x))
                    x.sync_future = None
        return await fut

    @staticmethod
    def _sync_response(g: Group, m: Member) -> dict[str, Any]:
        return {"throttle_time_ms": 0, "error_code": 0, "protocol_type": g.protocol_type,
                "protocol_name": g.protocol, "assignment": m.assignment}

    def _check_member(self, g: Group, member_id: str, generation: int, instance: str | None) -> Member:
        m = g.members.get(member_id)
        if m is None:
            if instance is not None and g.static_member(instance) is not None:
                raise GroupError(ErrorCode.FENCED_INSTANCE_ID)
            raise GroupError(ErrorCode.UNKNOWN_MEMBER_ID, f"unknown member {member_id!r}")
        if generation != g.generation:
            raise GroupError(ErrorCode.ILLEGAL_GENERATION, f"generation {generation}, group is at {g.generation}")
        return m

    # ------------------------------------------------------- heartbeat/leave
    async def heartbeat(self, req: dict[str, Any]) -> None:
        g = await self._group(req["group_id"])
        if g is None:
            raise GroupError(ErrorCode.UNKNOWN_MEMBER_ID)
        async with g.lock:
            m = g.members.get(req["member_id"])
            if m is not None and g.state == PREPARING:
                m.last_heartbeat = time.monotonic()
                raise GroupError(ErrorCode.REBALANCE_IN_PROGRESS)
            m = self._check_member(g, req["member_id"], req["generation_id"], req.get("group_instance_id"))
            m.last_heartbeat = time.monotonic()

    async def leave(self, group_id: str, members: list[tuple[str, str | None]]) -> list[ErrorCode]:
        g = await self._group(group_id)
        if g is None:
            return [ErrorCode.UNKNOWN_MEMBER_ID] * len(members)
        out = []
        async with g.lock:
            for member_id, instance in members:
                m = g.members.get(member_id) if member_id else (g.static_member(instance) if instance else None)
                if m is None:
                    out.append(ErrorCode.UNKNOWN_MEMBER_ID)
                    continue
                self._remove(g, m, "left the group")
                out.append(ErrorCode.NONE)
        return out

    def _remove(self, g: Group, m: Member, why: str) -> None:
        log.info("group %s: member %s %s", g.group_id, m.member_id, why)
        del g.members[m.member_id]
        for fut in (m.join_future, m.sync_future):
            if fut is not None and not fut.done():
                fut.set_exception(GroupError(ErrorCode.UNKNOWN_MEMBER_ID))
        if g.state in (STABLE, COMPLETING, EMPTY):
            if not g.members:
                g.state, g.protocol, g.leader = EMPTY, None, None
                g.generation += 1
                self._persist_later(g)
            else:
                self._prepare_rebalance(g, f"member {m.member_id} {why}")
        else:
            self._maybe_complete_join(g)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            if not self.lease_valid():
                continue
            now = time.monotonic()
            for g in list(self.groups.values()):
                async with g.lock:
                    g.pending = {k: v for k, v in g.pending.items() if v > now}
                    for m in list(g.members.values()):
                        waiting = m.join_future is not None and not m.join_future.done()
                        if not waiting and now - m.last_heartbeat > m.session_timeout_ms / 1000:
                            self._remove(g, m, "session timed out")

    async def _save(self, g: Group) -> bool:
        """Write the group's state to etcd now; False (logged) if that failed."""
        try:
            await self.meta.save_group(g.group_id, g.to_json())
            return True
        except Exception as exc:
            log.warning("group %s: could not save state to etcd: %r", g.group_id, exc)
            return False

    def _persist_later(self, g: Group) -> None:
        """Have the group's state reach etcd, retrying while it fails; one
        writer per group, always writing the newest state."""
        g.dirty = True
        if g.persister is None or g.persister.done():
            g.persister = asyncio.create_task(self._persist_loop(g), name=f"persist group {g.group_id}")

    async def _persist_loop(self, g: Group) -> None:
        delay = 0.1
        while g.dirty and self.groups.get(g.group_id) is g:  # an evicted group is another broker's now
            g.dirty = False
            if not await self._save(g):
                g.dirty = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --------------------------------------------------------------- offsets
    async def check_committer(self, group_id: str, generation: int, member_id: str, instance: str | None) -> None:
        """Whether this member (or a client outside any group's generation)
        may commit the group's offsets: GroupError if not."""
        g = await self._group(group_id)
        if g is not None and (g.members or generation >= 0):
            async with g.lock:
                if g.members or member_id:
                    m = self._check_member(g, member_id, generation, instance)
                    if g.state == COMPLETING:
                        raise GroupError(ErrorCode.REBALANCE_IN_PROGRESS)
                    m.last_heartbeat = time.monotonic()
        elif g is None and generation >= 0:
            raise GroupError(ErrorCode.ILLEGAL_GENERATION, "the group has no generation")

    def queue_offsets(self, group_id: str, offsets: dict[TopicPartition, dict[str, Any]]) -> Awaitable[None]:
        """Queue offsets for the group's next etcd write; the result is
        awaited until they are written (or raises why not). The offsets
        queued while a write is under way go in the next one together, in
        the order they were queued: a consumer committing after every message
        costs a transaction per write, not per commit, and the last commit of
        a partition is the one that stays."""
        queued = self._queued.get(group_id)
        if queued is None:
            queued = self._queued[group_id] = ({}, asyncio.get_running_loop().create_future())
            if group_id not in self._writers:
                self._writers[group_id] = asyncio.create_task(self._write_offsets(group_id))
        queued[0].update(offsets)
        return asyncio.shield(queued[1])  # a commit given up on (its connection closed) leaves the others waiting

    async def _write_offsets(self, group_id: str) -> None:
        """Write a group's queued offsets until none are left."""
        try:
            while (queued := self._queued.pop(group_id, None)) is not None:
                offsets, written = queued
                try:
                    await self.meta.commit_offsets(group_id, offsets)
                except Exception as exc:
                    written.set_exception(exc)
                else:
                    written.set_result(None)
        finally:  # cancelled (the coordinator closing): the commits waiting are not answered
            del self._writers[group_id]

    async def fetch_offsets(self, group_id: str) -> dict[tuple[str, int], dict[str, Any]]:
        return await self.meta.fetch_offsets(group_id)

    async def delete_offsets(self, group_id: str, partitions: list[TopicPartition]) -> dict[TopicPartition, ErrorCode]:
        """OffsetDelete (KIP-496): forget the committed offsets of these
        partitions, except those of topics the group's members subscribe to
        while it has members (GROUP_SUBSCRIBED_TO_TOPIC, as in Kafka). A group
        with neither state nor offsets is GROUP_ID_NOT_FOUND."""
        g = await self._group(group_id)
        if g is None and group_id not in await self.meta.group_names_with_offsets():
            raise GroupError(ErrorCode.GROUP_ID_NOT_FOUND, f"group {group_id}")
        in_use: set[str] | None = set()  # None: every topic (a subscription we cannot read)
        if g is not None and g.members:
            for m in g.members.values():
                try:
                    topics = decode_subscription(m.metadata(g.protocol)) if g.protocol_type == "consumer" else None
                except Exception:
                    topics = None
                in_use = None if topics is None or in_use is None else in_use | set(topics)
        out = {tp: ErrorCode.GROUP_SUBSCRIBED_TO_TOPIC if in_use is None or tp.topic in in_use else ErrorCode.NONE
               for tp in partitions}
        await self.meta.forget_offsets(group_id, [tp for tp, code in out.items() if code == ErrorCode.NONE])
        return out

    # ------------------------------------------------------------------ admin
    async def describe(self, group_id: str) -> dict[str, Any]:
        g = await self._group(group_id)
        if g is None:
            state = EMPTY if group_id in await self.meta.group_names_with_offsets() else DEAD
            return {"error_code": 0, "group_id": group_id, "group_state": state, "protocol_type": "",
                    "protocol_data": "", "members": []}
        stable = g.state == STABLE
        return {"error_code": 0, "group_id": group_id, "group_state": g.state,
                "protocol_type": g.protocol_type or "", "protocol_data": g.protocol or "",
                "members": [{"member_id": m.member_id, "group_instance_id": m.group_instance_id,
                             "client_id": m.client_id, "client_host": m.client_host,
                             "member_metadata": m.metadata(g.protocol), "member_assignment": m.assignment if stable
                             else b""} for m in g.members.values()]}

    async def list(self) -> list[tuple[str, str, str]]:
        """(group id, protocol type, state) of every known group."""
        out = {gid: (g.protocol_type or "", g.state) for gid, g in self.groups.items()}
        for gid in await self.meta.group_names_with_offsets():
            out.setdefault(gid, ("consumer", EMPTY))
        return [(gid, pt, st) for gid, (pt, st) in sorted(out.items())]

    async def delete(self, group_id: str) -> ErrorCode:
        g = await self._group(group_id)
        if g is not None and g.members:
            return ErrorCode.NON_EMPTY_GROUP
        if g is None and group_id not in await self.meta.group_names_with_offsets():
            return ErrorCode.GROUP_ID_NOT_FOUND
        self.groups.pop(group_id, None)
        await self.meta.delete_group(group_id)
        return ErrorCode.NONE


def offset_record(offset: int, metadata: str | None, leader_epoch: int) -> dict[str, Any]:
    if metadata is not None and len(metadata) > MAX_OFFSET_METADATA:
        raise GroupError(ErrorCode.OFFSET_METADATA_TOO_LARGE)
    return {"offset": offset, "metadata": metadata or "", "leader_epoch": leader_epoch,
            "commit_ms": int(time.time() * 1000)}

