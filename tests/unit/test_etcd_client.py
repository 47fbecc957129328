"""encode_txn sends exactly the TxnRequest aetcd's own transaction would."""
from __future__ import annotations

import aetcd
import pytest
from aetcd import rpc

from kafscale.metadata.etcd_client import encode_txn


def aetcd_request(client: aetcd.Client, compare: list, success: list, failure: list) -> rpc.TxnRequest:
    return rpc.TxnRequest(compare=[c.build_message() for c in compare],
                          success=client._ops_to_requests(success), failure=client._ops_to_requests(failure))


def test_encode_txn_matches_aetcd_for_every_compare_and_operation():
    client = aetcd.Client()
    tx = client.transactions
    # operands of zero and empty ones too: a compare's operand is a oneof, sent even when it is the default
    compare = [tx.value(b"/a") == b"x" * 300, tx.value("/s") != "y", tx.value(b"/e") == b"", tx.version(b"/b") > 0,
               tx.version(b"/b2") == 0, tx.create(b"/c") < 7, tx.mod(b"/d", range_end=b"/e") == 1 << 40]
    success = [tx.put(b"/p", b"v"), tx.put(b"/q", b"w" * 200_000, lease=(1 << 62) + 5, prev_kv=True),
               tx.put(b"/z", b""), tx.get(b"/g"), tx.get(b"/g", range_end=b"/h"), tx.delete(b"/x"),
               tx.delete(b"/x", range_end=b"/y", prev_kv=True)]
    failure = [tx.put(b"/f", b"", lease=3)]
    mine = encode_txn(compare, success, failure)
    want = aetcd_request(client, compare, success, failure)
    assert rpc.TxnRequest.FromString(mine) == want and mine == want.SerializeToString()
    assert [c.WhichOneof("target_union") for c in rpc.TxnRequest.FromString(mine).compare][2:5] == \
        ["value", "version", "version"]
    assert encode_txn([], [], []) == b""


def test_encode_txn_refuses_what_it_cannot_send():
    tx = aetcd.Client().transactions
    with pytest.raises(ValueError):
        encode_txn([tx.value(b"/a")], [], [])  # a compare without an operator
    with pytest.raises(TypeError):
        encode_txn([], [tx.txn([], [], [])], [])
