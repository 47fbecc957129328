"""Incremental fetch sessions (KIP-227): which Fetch begins, continues or ends
a session, what an incremental Fetch fetches, and what its answer holds."""
from __future__ import annotations

import pytest

from kafscale.broker import fetch_sessions
from kafscale.broker.fetch_sessions import ChangeLog, FetchSessions
from kafscale.protocol.errors import ErrorCode, KafkaError

USER = "User:ANONYMOUS"


def part(p: int, offset: int) -> dict:
    return {"partition": p, "fetch_offset": offset, "partition_max_bytes": 1 << 20}


def request(session_id: int, epoch: int, topics: dict[str, list[tuple[int, int]]],
            forgotten: dict[str, list[int]] | None = None) -> dict:
    return {"session_id": session_id, "session_epoch": epoch,
            "topics": [{"topic": t, "partitions": [part(p, o) for p, o in ps]} for t, ps in topics.items()],
            "forgotten_topics_data": [{"topic": t, "partitions": ps} for t, ps in (forgotten or {}).items()]}


def fetched(topics: list[dict]) -> dict[str, dict[int, int]]:
    return {t["topic"]: {p["partition"]: p["fetch_offset"] for p in t["partitions"]} for t in topics}


def test_a_full_fetch_with_epoch_0_begins_a_session_and_epoch_minus_1_fetches_without_one():
    s = FetchSessions(10)
    session, topics, incremental = s.begin(request(0, -1, {"a": [(0, 0)]}), USER, False)
    assert (session, incremental, len(s)) == (None, False, 0)
    assert fetched(topics) == {"a": {0: 0}}
    session, topics, incremental = s.begin(request(0, 0, {"a": [(0, 0), (1, 5)]}), USER, False)
    assert session is not None and session.id != 0 and not incremental and len(s) == 1
    assert fetched(topics) == {"a": {0: 0, 1: 5}}


def test_an_incremental_fetch_fetches_the_whole_session_with_the_changes_it_names():
    s = FetchSessions(10)
    session, _, _ = s.begin(request(0, 0, {"a": [(0, 0), (1, 0)], "b": [(0, 7)]}), USER, False)
    assert session is not None
    got, topics, incremental = s.begin(request(session.id, 1, {"a": [(1, 3)], "c": [(2, 0)]}, {"b": [0]}), USER,
                                       False)
    assert got is session and incremental and topics == []
    assert fetched(session.due(ChangeLog())) == {"a": {0: 0, 1: 3}, "c": {2: 0}}, "no pass yet: all of it"


def test_an_incremental_pass_fetches_what_was_named_changed_or_is_still_active():
    changes, s = ChangeLog(), FetchSessions(10)
    session, topics, _ = s.begin(request(0, 0, {"a": [(0, 0), (1, 0), (2, 0), (3, 0)]}), USER, False)
    session.seen = changes.end
    # 1 is behind its high watermark (not read: max_bytes ran out), 3 had an error
    session.answered(topics[0], "a", [(0, 0, 0, 0, None), (1, 0, 5, 0, None), (2, 0, 0, 0, None),
                                      (3, 6, -1, -1, None)], incremental=False)
    s.begin(request(session.id, 1, {}), USER, False)
    assert fetched(session.due(changes)) == {"a": {1: 0, 3: 0}}
    changes.add("a", 2)
    changes.add("b", 0)  # not the session's
    s.begin(request(session.id, 2, {"a": [(0, 0)]}), USER, False)
    due = session.due(changes)
    assert fetched(due) == {"a": {0: 0, 1: 0, 2: 0, 3: 0}}
    session.answered(due[0], "a", [(0, 0, 0, 0, None), (1, 0, 5, 0, [b"r"]), (2, 0, 1, 0, [b"r"]),
                                   (3, 0, 0, 0, None)], incremental=True)
    s.begin(request(session.id, 3, {"a": [(1, 5), (2, 1)]}), USER, False)  # both read up to their end
    assert [p["partition"] for p in session.due(changes)[0]["partitions"]] == [1, 2], "records: fetched again"
    session.answered(due[0], "a", [(1, 0, 5, 0, None), (2, 0, 1, 0, None)], incremental=True)
    s.begin(request(session.id, 4, {}), USER, False)
    assert session.due(changes) == [], "caught up and unchanged: nothing to fetch"


def test_a_session_behind_the_change_log_or_after_an_acl_change_fetches_everything():
    changes, s = ChangeLog(kept=2), FetchSessions(10)
    session, topics, _ = s.begin(request(0, 0, {"a": [(0, 0), (1, 0)]}), USER, False)
    session.seen = changes.end
    session.answered(topics[0], "a", [(0, 0, 0, 0, None), (1, 0, 0, 0, None)], incremental=False)
    for _ in range(5):
        changes.add("x", 0)
    s.begin(request(session.id, 1, {}), USER, False)
    assert fetched(session.due(changes)) == {"a": {0: 0, 1: 0}}
    session.answered(topics[0], "a", [(0, 0, 0, 0, None), (1, 0, 0, 0, None)], incremental=True)
    s.begin(request(session.id, 2, {}), USER, False)
    assert session.due(changes) == []
    s.revisit()  # the ACLs changed
    s.begin(request(session.id, 3, {}), USER, False)
    assert fetched(session.due(changes)) == {"a": {0: 0, 1: 0}}


def test_out_of_turn_unknown_and_foreign_sessions_are_refused_with_kafkas_codes():
    s = FetchSessions(10)
    session, _, _ = s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)
    assert session is not None
    with pytest.raises(KafkaError) as exc:
        s.begin(request(session.id, 2, {}), USER, False)
    assert exc.value.code == ErrorCode.INVALID_FETCH_SESSION_EPOCH and exc.value.code.retriable
    with pytest.raises(KafkaError) as exc:
        s.begin(request(session.id + 1, 1, {}), USER, False)
    assert exc.value.code == ErrorCode.FETCH_SESSION_ID_NOT_FOUND
    with pytest.raises(KafkaError) as exc:  # another principal cannot use it
        s.begin(request(session.id, 1, {}), "User:mallory", False)
    assert exc.value.code == ErrorCode.FETCH_SESSION_ID_NOT_FOUND
    assert s.begin(request(session.id, 1, {}), USER, False)[0] is session, "refusals leave the session as it was"
    with pytest.raises(KafkaError) as exc:  # begun by topic name, continued by topic id
        s.begin({"session_id": session.id, "session_epoch": 2, "topics": []}, USER, True)
    assert exc.value.code == ErrorCode.FETCH_SESSION_TOPIC_ID_ERROR


def test_a_full_fetch_naming_a_session_ends_it():
    s = FetchSessions(10)
    session, _, _ = s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)
    assert session is not None
    assert s.begin(request(session.id, -1, {"a": [(0, 0)]}), USER, False)[0] is None
    assert len(s) == 0
    with pytest.raises(KafkaError):
        s.begin(request(session.id, 1, {}), USER, False)
    renewed, _, _ = s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)
    again, _, _ = s.begin(request(renewed.id, 0, {"a": [(0, 0)]}), USER, False)  # epoch 0 on a session: a new one
    assert again is not None and again.id != renewed.id and len(s) == 1


def test_the_epoch_wraps_to_1():
    s = FetchSessions(1)
    session, _, _ = s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)
    session.epoch = 0x7FFFFFFF
    s.begin(request(session.id, 0x7FFFFFFF, {}), USER, False)
    assert session.epoch == 1


def test_an_incremental_answer_holds_only_partitions_with_something_new():
    s = FetchSessions(10)
    session, topics, _ = s.begin(request(0, 0, {"a": [(0, 0), (1, 0), (2, 0)]}), USER, False)
    t = topics[0]
    full = [(0, 0, 5, 0, [b"r"]), (1, 0, 0, 0, None), (2, 0, 3, 0, [b"r"])]
    assert session.answered(t, "a", full, incremental=False) == full, "a full answer holds every partition"
    s.begin(request(session.id, 1, {"a": [(0, 5), (2, 3)]}), USER, False)
    assert session.answered(t, "a", [(0, 0, 5, 0, None), (1, 0, 0, 0, None), (2, 0, 3, 0, None)], True) == []
    parts = [(0, 0, 6, 0, None), (1, 6, -1, -1, None), (2, 0, 3, 1, None)]  # hw moved, an error, log start moved
    assert session.answered(t, "a", parts, True) == parts
    assert session.answered(t, "a", [(0, 0, 6, 0, None), (1, 0, 0, 0, None), (2, 0, 3, 1, None)], True) == [
        (1, 0, 0, 0, None)], "a partition whose error cleared is answered again"


def test_partitions_that_returned_records_move_to_the_end_of_the_fetch_order():
    s = FetchSessions(10)
    session, topics, _ = s.begin(request(0, 0, {"a": [(0, 0), (1, 0), (2, 0)], "b": [(0, 0)]}), USER, False)
    session.answered(topics[0], "a", [(0, 0, 1, 0, [b"r"]), (1, 0, 0, 0, None), (2, 0, 0, 0, None)], False)
    s.begin(request(session.id, 1, {}), USER, False)
    assert [(t["topic"], [p["partition"] for p in t["partitions"]]) for t in session.due(ChangeLog())] == [
        ("a", [1, 2, 0]), ("b", [0])]


def test_a_session_by_topic_id_keys_its_partitions_by_id():
    s = FetchSessions(10)
    tid = b"\x07" * 16
    req = {"session_id": 0, "session_epoch": 0,
           "topics": [{"topic_id": tid, "partitions": [part(0, 0), part(1, 0)]}]}
    session, _, _ = s.begin(req, USER, True)
    req = {"session_id": session.id, "session_epoch": 1, "topics": [],
           "forgotten_topics_data": [{"topic_id": tid, "partitions": [1]}]}
    s.begin(req, USER, True)
    assert session.due(ChangeLog()) == [{"topic_id": tid, "partitions": [part(0, 0)]}]


def test_a_full_cache_replaces_only_sessions_idle_long_enough(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(fetch_sessions.time, "monotonic", lambda: clock[0])
    s = FetchSessions(2)
    first, _, _ = s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)
    clock[0] += 10
    second, _, _ = s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)
    assert first is not None and second is not None
    clock[0] += fetch_sessions.EVICT_IDLE_S - 15
    assert s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)[0] is None, "full: answered without a session"
    s.begin(request(first.id, 1, {}), USER, False)  # the first is used: the second is now the idlest
    clock[0] += 20
    third, _, _ = s.begin(request(0, 0, {"a": [(0, 0)]}), USER, False)
    assert third is not None and len(s) == 2
    with pytest.raises(KafkaError):
        s.begin(request(second.id, 1, {}), USER, False)
    assert FetchSessions(0).begin(request(0, 0, {"a": [(0, 0)]}), USER, False)[0] is None
