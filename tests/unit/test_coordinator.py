"""The group coordinator's state machine (groups/coordinator.py) on the
in-memory etcd twin: join with a required member id, one generation for all
members, the leader's assignment handed out and saved, a restarted
coordinator carrying on from etcd without a rebalance, a leave forcing the
others to rejoin, an expired session, a save that fails, and a commit whose
outcome etcd left unknown."""
from __future__ import annotations

import asyncio

import pytest
from aetcd.exceptions import ConnectionFailedError, ConnectionTimeoutError

from kafscale.groups.coordinator import COMPLETING, EMPTY, STABLE, GroupCoordinator, GroupError, offset_record
from kafscale.metadata.memory import MemoryEtcd
from kafscale.metadata.store import UNCERTAIN_WRITE_ATTEMPTS, MetaStore
from kafscale.protocol.errors import ErrorCode

GROUP = "g"


def join_req(member_id: str = "", session_ms: int = 10_000) -> dict:
    return {"group_id": GROUP, "session_timeout_ms": session_ms, "rebalance_timeout_ms": 5_000,
            "member_id": member_id, "group_instance_id": None, "protocol_type": "consumer",
            "protocols": [{"name": "range", "metadata": b"sub"}]}


async def join(coord: GroupCoordinator, client: str, session_ms: int = 10_000) -> dict:
    """A v4+ join: the first answer asks for the member id, the second joins."""
    first = await coord.join(join_req(session_ms=session_ms), 9, client, "/127.0.0.1")
    assert first["error_code"] == ErrorCode.MEMBER_ID_REQUIRED and first["member_id"].startswith(client)
    return await coord.join(join_req(first["member_id"], session_ms), 9, client, "/127.0.0.1")


async def form_group(coord: GroupCoordinator) -> tuple[dict, dict]:
    a, b = await asyncio.gather(join(coord, "a"), join(coord, "b"))
    assert a["generation_id"] == b["generation_id"] == 1 and a["leader"] == b["leader"]
    leader, other = (a, b) if a["leader"] == a["member_id"] else (b, a)
    assert {m["member_id"] for m in leader["members"]} == {a["member_id"], b["member_id"]} and other["members"] == []
    assignments = [{"member_id": leader["member_id"], "assignment": b"p0"},
                   {"member_id": other["member_id"], "assignment": b"p1"}]

    def sync(resp: dict, given: list) -> dict:
        return {"group_id": GROUP, "generation_id": 1, "member_id": resp["member_id"], "assignments": given}

    got = await asyncio.gather(coord.sync(sync(leader, assignments)), coord.sync(sync(other, [])))
    assert [r["assignment"] for r in got] == [b"p0", b"p1"]
    return leader, other


def run(coro):
    async def go():
        try:
            return await asyncio.wait_for(coro, 30)
        finally:
            for t in asyncio.all_tasks() - {asyncio.current_task()}:
                t.cancel()

    return asyncio.run(go())


def test_a_group_forms_and_a_restarted_coordinator_carries_on_without_rebalancing():
    async def go():
        meta = MetaStore.in_memory()
        coord = GroupCoordinator(meta, initial_rebalance_delay_ms=300)  # both join within the delay
        _leader, other = await form_group(coord)
        assert coord.groups[GROUP].state == STABLE
        await asyncio.sleep(0.05)
        saved = await meta.load_group(GROUP)
        assert saved["generation"] == 1 and len(saved["members"]) == 2
        successor = GroupCoordinator(meta, initial_rebalance_delay_ms=0)  # another broker, same etcd
        await successor.heartbeat({"group_id": GROUP, "generation_id": 1, "member_id": other["member_id"]})
        assert successor.groups[GROUP].state == STABLE and successor.groups[GROUP].generation == 1

    run(go())


def test_a_leave_makes_the_others_rejoin_in_a_new_generation():
    async def go():
        coord = GroupCoordinator(MetaStore.in_memory(), initial_rebalance_delay_ms=300)
        leader, other = await form_group(coord)
        assert await coord.leave(GROUP, [(leader["member_id"], None)]) == [ErrorCode.NONE]
        with pytest.raises(GroupError) as err:
            await coord.heartbeat({"group_id": GROUP, "generation_id": 1, "member_id": other["member_id"]})
        assert err.value.code == ErrorCode.REBALANCE_IN_PROGRESS
        again = await coord.join(join_req(other["member_id"]), 9, "b", "/127.0.0.1")
        assert again["generation_id"] == 2 and again["leader"] == other["member_id"]
        assert coord.groups[GROUP].state == COMPLETING

    run(go())


def test_an_expired_session_removes_the_member():
    async def go():
        coord = GroupCoordinator(MetaStore.in_memory(), initial_rebalance_delay_ms=0)
        await coord.start()
        joined = await join(coord, "a", session_ms=1_000)
        await coord.sync({"group_id": GROUP, "generation_id": 1, "member_id": joined["member_id"],
                          "assignments": [{"member_id": joined["member_id"], "assignment": b"all"}]})
        await asyncio.sleep(1.6)  # no heartbeat
        assert coord.groups[GROUP].state == EMPTY and not coord.groups[GROUP].members
        await coord.close()

    run(go())


def test_an_assignment_that_cannot_be_saved_is_not_handed_out():
    async def go():
        etcd = MemoryEtcd()
        coord = GroupCoordinator(MetaStore.in_memory(etcd=etcd), initial_rebalance_delay_ms=0)
        joined = await join(coord, "a")
        etcd.down = True
        with pytest.raises(GroupError) as err:
            await coord.sync({"group_id": GROUP, "generation_id": 1, "member_id": joined["member_id"],
                              "assignments": [{"member_id": joined["member_id"], "assignment": b"all"}]})
        assert err.value.code == ErrorCode.COORDINATOR_NOT_AVAILABLE
        assert coord.groups[GROUP].state != STABLE

    run(go())


def test_a_commit_whose_outcome_etcd_left_unknown_is_sent_again_before_it_is_answered():
    """A timed-out transaction may still be applied: answering it with an
    error would let the client's next commit be overtaken by it."""
    async def go():
        etcd = MemoryEtcd()
        coord = GroupCoordinator(MetaStore.in_memory(etcd=etcd), initial_rebalance_delay_ms=0)
        transaction, timeouts = etcd.transaction, [ConnectionTimeoutError("deadline"), ConnectionFailedError("gone")]

        async def flaky(*args, **kwargs):
            if timeouts:
                raise timeouts.pop(0)
            return await transaction(*args, **kwargs)

        etcd.transaction = flaky
        await coord.queue_offsets(GROUP, {("t", 0): offset_record(7, None, -1)})
        assert (await coord.fetch_offsets(GROUP))[("t", 0)]["offset"] == 7
        timeouts.extend(ConnectionTimeoutError("deadline") for _ in range(UNCERTAIN_WRITE_ATTEMPTS))
        with pytest.raises(ConnectionTimeoutError):
            await coord.queue_offsets(GROUP, {("t", 0): offset_record(8, None, -1)})
        assert not timeouts and (await coord.fetch_offsets(GROUP))[("t", 0)]["offset"] == 7

    run(go())


def test_commits_queued_while_a_write_is_under_way_go_in_the_next_one_and_the_last_wins():
    async def go():
        etcd = MemoryEtcd()
        coord = GroupCoordinator(MetaStore.in_memory(etcd=etcd), initial_rebalance_delay_ms=0)
        transaction, gate = etcd.transaction, asyncio.Event()

        async def held(*args, **kwargs):
            await gate.wait()
            return await transaction(*args, **kwargs)

        etcd.transaction = held
        before = etcd.txns
        first = coord.queue_offsets(GROUP, {("t", 0): offset_record(1, None, -1)})
        await asyncio.sleep(0.01)  # its write is under way
        later = [coord.queue_offsets(GROUP, {("t", i % 2): offset_record(i, None, -1)}) for i in range(2, 101)]
        gate.set()
        await asyncio.gather(first, *later)
        assert etcd.txns - before == 2
        assert {tp: v["offset"] for tp, v in (await coord.fetch_offsets(GROUP)).items()} == {("t", 0): 100,
                                                                                              ("t", 1): 99}
        etcd.down = True
        failed = await asyncio.gather(*(coord.queue_offsets(GROUP, {("t", 0): offset_record(i, None, -1)})
                                        for i in range(3)), return_exceptions=True)
        assert all(isinstance(e, Exception) for e in failed) and len({id(e) for e in failed}) == 1

    run(go())
