"""ACL evaluation and filters with Kafka's semantics, and the SASL exchange
driven by a real SCRAM client (scramp) and PLAIN tokens."""
from __future__ import annotations

import asyncio

import pytest
from scramp import ScramClient

from kafscale.security.acl import (
    CLUSTER,
    AclBinding,
    Authorizer,
    Operation,
    PatternType,
    Permission,
    ResourceType,
)
from kafscale.security.sasl import SaslExchange, SaslFailed, make_credentials

T, G, C = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.CLUSTER
LIT, PRE = PatternType.LITERAL, PatternType.PREFIXED
ALLOW, DENY = Permission.ALLOW, Permission.DENY


def acl(rtype: int, name: str, op: Operation, principal: str = "User:alice", perm: Permission = ALLOW,
        pattern: PatternType = LIT, host: str = "*") -> AclBinding:
    return AclBinding(rtype, name, pattern, principal, host, op, perm)


def authz(*acls: AclBinding, allow_if_no_acl: bool = False) -> Authorizer:
    a = Authorizer(True, "User:admin;User:ops", allow_if_no_acl)
    a.update(acls)
    return a


def test_allow_deny_implied_and_patterns():
    a = authz(acl(T, "orders-", Operation.WRITE, pattern=PRE), acl(T, "orders-secret", Operation.ALL, perm=DENY),
              acl(T, "*", Operation.READ, principal="User:*"), acl(G, "g1", Operation.READ))
    alice = ("User:alice", "/127.0.0.1")
    assert a.allows(*alice, Operation.WRITE, T, "orders-eu")
    assert a.allows(*alice, Operation.DESCRIBE, T, "orders-eu"), "Write implies Describe"
    assert not a.allows(*alice, Operation.WRITE, T, "orders-secret"), "DENY wins over a matching ALLOW"
    assert not a.allows(*alice, Operation.DESCRIBE, T, "orders-secret"), "DENY ALL covers Describe"
    assert not a.allows(*alice, Operation.WRITE, T, "payments")
    assert a.allows("User:bob", "/10.0.0.1", Operation.READ, T, "anything"), "User:* and the * topic"
    assert not a.allows("User:bob", "/10.0.0.1", Operation.WRITE, T, "anything")
    assert a.allows(*alice, Operation.READ, G, "g1") and not a.allows(*alice, Operation.READ, G, "g2")
    assert a.allows("User:admin", "/1.2.3.4", Operation.ALTER, C, CLUSTER), "super users bypass ACLs"
    assert not a.allows(*alice, Operation.ALTER, C, CLUSTER)


def test_deny_on_read_does_not_deny_describe_and_hosts_match():
    a = authz(acl(T, "t", Operation.READ, perm=DENY), acl(T, "t", Operation.DESCRIBE),
              acl(T, "h", Operation.READ, host="10.0.0.5"))
    assert not a.allows("User:alice", "/127.0.0.1", Operation.READ, T, "t")
    assert a.allows("User:alice", "/127.0.0.1", Operation.DESCRIBE, T, "t")
    assert a.allows("User:alice", "/10.0.0.5", Operation.READ, T, "h")
    assert not a.allows("User:alice", "/10.0.0.6", Operation.READ, T, "h")


def test_resources_no_acl_names_follow_the_default():
    acls = (acl(T, "named", Operation.READ, principal="User:bob"),)
    assert not authz(*acls).allows("User:alice", "", Operation.READ, T, "unnamed"), "deny by default"
    assert authz(*acls, allow_if_no_acl=True).allows("User:alice", "", Operation.READ, T, "unnamed")
    assert not authz(*acls, allow_if_no_acl=True).allows("User:alice", "", Operation.READ, T, "named"), \
        "a resource with ACLs is decided by them alone"
    assert Authorizer(False).allows("User:ANONYMOUS", "", Operation.ALTER, C, CLUSTER), "no authorizer: allowed"


def test_idempotent_producers_need_write_on_some_topic():
    a = authz(acl(T, "orders-", Operation.WRITE, pattern=PRE), acl(T, "x", Operation.READ, principal="User:bob"))
    assert a.allows_any_topic("User:alice", "", Operation.WRITE)
    assert not a.allows_any_topic("User:bob", "", Operation.WRITE)


def test_filters_match_like_kafka():
    lit = acl(T, "orders", Operation.READ)
    pre = acl(T, "ord", Operation.WRITE, pattern=PRE)
    any_filter = {"resource_type_filter": ResourceType.ANY, "resource_name_filter": None,
                  "pattern_type_filter": PatternType.ANY, "principal_filter": None, "host_filter": None,
                  "operation": Operation.ANY, "permission_type": Permission.ANY}
    assert lit.matches_filter(any_filter) and pre.matches_filter(any_filter)
    match = {**any_filter, "pattern_type_filter": PatternType.MATCH, "resource_name_filter": "orders"}
    assert lit.matches_filter(match) and pre.matches_filter(match), "MATCH: every binding that applies"
    exact = {**any_filter, "pattern_type_filter": LIT, "resource_name_filter": "orders"}
    assert lit.matches_filter(exact) and not pre.matches_filter(exact)
    assert not lit.matches_filter({**any_filter, "operation": Operation.WRITE})
    assert not lit.matches_filter({**any_filter, "principal_filter": "User:bob"})


def test_invalid_bindings_are_refused():
    assert acl(T, "t", Operation.READ).invalid() is None
    assert acl(C, "other", Operation.ALTER).invalid()
    assert acl(T, "t", Operation.ANY).invalid()
    assert acl(T, "t", Operation.READ, principal="alice").invalid()
    assert AclBinding(ResourceType.USER, "u", LIT, "User:a", "*", Operation.READ, ALLOW).invalid()
    assert acl(T, "t", Operation.READ).id == acl(T, "t", Operation.READ).id != acl(T, "t", Operation.WRITE).id


@pytest.fixture(scope="module")
def users() -> dict[str, dict]:
    return {"alice": make_credentials("wonderland")}


def run_scram(mechanism: str, user: str, password: str, users: dict[str, dict]) -> SaslExchange:
    async def lookup(name: str) -> dict | None:
        return users.get(name)

    async def go() -> SaslExchange:
        ex = SaslExchange(mechanism, lookup)
        client = ScramClient([mechanism], user, password)
        client.set_server_first((await ex.step(client.get_client_first().encode())).decode())
        client.set_server_final((await ex.step(client.get_client_final().encode())).decode())
        return ex

    return asyncio.run(go())


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_scram_exchange(mechanism, users):
    assert run_scram(mechanism, "alice", "wonderland", users).principal == "User:alice"
    with pytest.raises(SaslFailed, match="invalid credentials"):
        run_scram(mechanism, "alice", "looking-glass", users)
    with pytest.raises(SaslFailed, match="invalid credentials"):
        run_scram(mechanism, "mallory", "wonderland", users)


def test_plain_exchange_checks_against_the_scram_credential(users):
    async def plain(token: bytes) -> SaslExchange:
        async def lookup(name: str) -> dict | None:
            return users.get(name)
        ex = SaslExchange("PLAIN", lookup)
        assert await ex.step(token) == b""
        return ex

    assert asyncio.run(plain(b"\x00alice\x00wonderland")).principal == "User:alice"
    assert asyncio.run(plain(b"alice\x00alice\x00wonderland")).principal == "User:alice"
    for bad in (b"\x00alice\x00nope", b"\x00bob\x00wonderland", b"bob\x00alice\x00wonderland", b"garbage"):
        with pytest.raises(SaslFailed):
            asyncio.run(plain(bad))
    stored = users["alice"]["SCRAM-SHA-256"]
    assert "wonderland" not in str(users) and stored["iterations"] >= 4096, "only salted hashes are stored"


def test_credentials_from_an_admin_clients_salted_password_match_the_password_ones():
    """AlterUserScramCredentials sends Hi(password, salt, i); the stored
    credential must equal the one `kafscale users add` derives from the password."""
    import hashlib

    from scramp import ScramMechanism

    from kafscale.security.sasl import ScramCredential

    salt = b"0123456789abcdef"
    for mechanism, digest in (("SCRAM-SHA-256", "sha256"), ("SCRAM-SHA-512", "sha512")):
        salted = hashlib.pbkdf2_hmac(digest, b"s3cret", salt, 8192)
        got = ScramCredential.from_salted_password(mechanism, salt, salted, 8192)
        assert got == ScramCredential(*ScramMechanism(mechanism).make_auth_info("s3cret", iteration_count=8192,
                                                                                 salt=salt))
