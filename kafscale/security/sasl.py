"""SASL authentication of Kafka connections: PLAIN and SCRAM-SHA-256/512.

Credentials are stored hashed in etcd (`users/{name}`), one SCRAM record per
mechanism (salt, iterations, StoredKey, ServerKey; RFC 5802), never the
password. SCRAM runs through `scramp`; PLAIN recomputes the StoredKey from
the offered password with the stored salt and iterations and compares it in
constant time, so one credential record serves both."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from scramp import ScramException, ScramMechanism

SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
MECHANISMS = ("PLAIN", *SCRAM_MECHANISMS)
MIN_ITERATIONS = 4096  # Kafka's minimum for SCRAM credentials
ANONYMOUS = "User:ANONYMOUS"


@dataclass(frozen=True)
class ScramCredential:
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    def to_json(self) -> dict[str, Any]:
        b64 = base64.b64encode
        return {"salt": b64(self.salt).decode(), "stored_key": b64(self.stored_key).decode(),
                "server_key": b64(self.server_key).decode(), "iterations": self.iterations}

    @classmethod
    def from_salted_password(cls, mechanism: str, salt: bytes, salted: bytes, iterations: int) -> ScramCredential:
        """What a Kafka admin client's AlterUserScramCredentials sends (SaltedPassword = Hi(password, salt, i))."""
        digest = "sha512" if mechanism.endswith("512") else "sha256"
        client_key = hmac.digest(salted, b"Client Key", digest)
        return cls(salt, hashlib.new(digest, client_key).digest(), hmac.digest(salted, b"Server Key", digest),
                   iterations)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScramCredential:
        b = base64.b64decode
        return cls(b(d["salt"]), b(d["stored_key"]), b(d["server_key"]), int(d["iterations"]))


def make_credentials(password: str, iterations: int = MIN_ITERATIONS) -> dict[str, dict[str, Any]]:
    """The stored form of a password: one SCRAM credential per mechanism."""
    if iterations < MIN_ITERATIONS:
        raise ValueError(f"iterations must be at least {MIN_ITERATIONS}")
    return {m: ScramCredential(*ScramMechanism(m).make_auth_info(password, iteration_count=iterations)).to_json()
            for m in SCRAM_MECHANISMS}


# user name -> its stored credentials (mechanism -> ScramCredential JSON), None if unknown
Lookup = Callable[[str], Awaitable[dict[str, Any] | None]]


class SaslFailed(Exception):
    """Authentication failed: the client gets SASL_AUTHENTICATION_FAILED and the connection closes."""


def _failed(mechanism: str) -> SaslFailed:
    # one message whatever went wrong; SCRAM still fails at another step for an
    # unknown user than for a wrong password (as in Kafka), so names can be probed
    return SaslFailed(f"Authentication failed: invalid credentials with SASL mechanism {mechanism}")


class SaslExchange:
    """One connection's authentication with one mechanism, token by token.
    `step` returns the server's token; `principal` is set once it succeeded."""

    def __init__(self, mechanism: str, lookup: Lookup) -> None:
        self.mechanism = mechanism
        self.lookup = lookup
        self.principal: str | None = None
        self._user = ""
        self._client_nonce = ""
        self._scram: Any = None

    async def step(self, token: bytes) -> bytes:
        if self.principal is not None:
            raise SaslFailed("authentication already completed")
        if self.mechanism == "PLAIN":
            return await self._plain(token)
        if self._scram is None:
            return await self._scram_first(token)
        return self._scram_final(token)

    async def _credential(self, user: str, mechanism: str) -> ScramCredential:
        stored = await self.lookup(user) if user else None
        if not stored or mechanism not in stored:
            raise _failed(self.mechanism)
        return ScramCredential.from_json(stored[mechanism])

    async def _plain(self, token: bytes) -> bytes:
        parts = token.split(b"\x00")
        if len(parts) != 3:
            raise SaslFailed("invalid PLAIN token: expected authzid NUL authcid NUL password")
        authzid, user, password = (p.decode("utf-8", "replace") for p in parts)
        if authzid and authzid != user:
            raise SaslFailed("PLAIN authorization id must be empty or the user name")
        cred = await self._credential(user, SCRAM_MECHANISMS[0])
        offered = await asyncio.to_thread(ScramMechanism(SCRAM_MECHANISMS[0]).make_auth_info, password,
                                          iteration_count=cred.iterations, salt=cred.salt)
        if not hmac.compare_digest(offered[1], cred.stored_key):
            raise _failed(self.mechanism)
        self.principal = f"User:{user}"
        return b""

    async def _scram_first(self, token: bytes) -> bytes:
        text = token.decode("utf-8", "replace")
        # client-first-message: gs2-header "," "n=" saslname "," "r=" nonce [...]
        fields = text.split(",")
        user = next((f[2:] for f in fields[2:3] if f.startswith("n=")), "")
        self._client_nonce = next((f[2:] for f in fields[3:4] if f.startswith("r=")), "")
        self._user = user.replace("=2C", ",").replace("=3D", "=")
        cred = await self._credential(self._user, self.mechanism)
        server = ScramMechanism(self.mechanism).make_server(
            lambda _name: (cred.salt, cred.stored_key, cred.server_key, cred.iterations))
        try:
            server.set_client_first(text)
            self._scram = server
            return server.get_server_first().encode()
        except ScramException as exc:
            raise SaslFailed(f"invalid SCRAM client-first message: {exc}") from None

    def _scram_final(self, token: bytes) -> bytes:
        text = token.decode("utf-8", "replace")
        nonce = next((f[2:] for f in text.split(",") if f.startswith("r=")), "")
        if nonce == self._client_nonce + str(self._scram.nonce):
            # librdkafka before 2.6.1 (Debian's kcat among others) repeats its own nonce in front of the
            # combined one; Kafka 3 brokers accepted that. The server's nonce is still checked in full,
            # and the proof is verified over the message exactly as the client sent it.
            self._scram.nonce = type(self._scram.nonce)(nonce)
        try:
            self._scram.set_client_final(text)
        except ScramException:
            raise _failed(self.mechanism) from None
        self.principal = f"User:{self._user}"
        return self._scram.get_server_final().encode()


PROXY_MECHANISM = "KAFSCALE-PROXY"


class ProxyIdentity:
    """The SASL exchange a `kafscale proxy` opens each of its connections to a
    broker with, on behalf of one client connection: one JSON token naming
    the shared secret (`proxy_secret`, known only to brokers and proxies), the
    client's principal and its address. The broker then authorizes that
    connection's requests as the client's, host ACLs included."""

    mechanism = PROXY_MECHANISM

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.principal: str | None = None
        self.client_host = ""

    @staticmethod
    def token(secret: str, principal: str, client_host: str) -> bytes:
        return json.dumps({"secret": secret, "principal": principal, "host": client_host}).encode()

    async def step(self, token: bytes) -> bytes:
        try:
            d = json.loads(token)
            secret, principal, host = str(d["secret"]), str(d["principal"]), str(d["host"])
        except (ValueError, KeyError, TypeError):
            raise SaslFailed("malformed proxy identity") from None
        if not hmac.compare_digest(secret.encode(), self.secret.encode()) or not principal.startswith("User:"):
            raise SaslFailed("proxy identity refused")
        self.principal, self.client_host = principal, host
        return b""
