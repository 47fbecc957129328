"""A request being served: its wire header (protocol/framing.py) and what the
server knows of it besides, which handlers and the log process use."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kafscale.protocol.framing import RequestHeader


async def _now() -> None:
    return


@dataclass
class RequestContext(RequestHeader):
    client_host: str = ""
    principal: str = "User:ANONYMOUS"  # who the connection authenticated as (SASL)
    # One per connection: Kafka handles a connection's requests one at a time,
    # so clients rely on pipelined produces being appended, and other requests
    # taking effect, in send order.
    append_order: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Run once the response has been handed to the socket (or dropped): a
    # worker unpins the shared-memory segments the response points into.
    on_sent: list[Callable[[], None]] = field(default_factory=list)
    # A connection's consecutive OffsetCommits run at once in the log process
    # (LogService._frames): each awaits its turn (the one before has its place
    # in the order, or was answered), then takes its place (queued for its
    # group's next etcd write) and says so.
    turn: Callable[[], Awaitable[None]] = _now
    placed: Callable[[], None] = lambda: None

