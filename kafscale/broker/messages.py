"""The messages between a node's protocol workers and its log process (sent
pickled over ipc.Channel). Calls go from a worker to the log process, which
answers each; events go from the log process to every worker.

A produce request crosses the hop as a ProduceCall, each partition's records
replaced: the worker puts a validated payload in its shared-memory ring and
sends a RingPayload (or a RejectedPayload saying why not); the log process
turns a RingPayload back into the bytes in place (produce_api.Accepted)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kafscale.broker.shm import CacheRef
from kafscale.metadata.store import SegmentManifest

# ------------------------------------------------------------ produce payloads
RingPayload = tuple[int, int, int]  # a validated payload: (slot, start, length) in worker slot's ring


@dataclass(frozen=True)
class RejectedPayload:
    """A payload the worker refused (invalid, too large, ring full): the partition's error."""
    code: int
    message: str


# ---------------------------------------------------------------------- calls
@dataclass(frozen=True)
class Hello:
    """A worker starts; answered with the current ACLs (AclBinding JSON each)."""
    slot: int


# A Produce request whose payloads are in the rings. The produce requests a
# client connection sends in one pass of the worker's event loop go as one call,
# a list of these, answered with a list: each one's answer (framing.ProduceAnswer:
# lists and tuples; None for acks=0), or a ProduceFailed. Each travels as a plain tuple: pickling one takes
# 1.3 µs, a dataclass holding the request dict and a dataclass per payload
# 9.5 µs (and about as much again to unpickle):
#   (conn, version, client_id, client_host, principal, acks, timeout_ms, transactional_id,
#    ((topic, ((partition, RingPayload | RejectedPayload), ...)), ...))
# conn is the client connection within the worker: its appends keep their order.
ProduceCall = tuple[int, int, str | None, str, str, int, int, str | None,
                    tuple[tuple[str, tuple[tuple[int, RingPayload | RejectedPayload], ...]], ...]]


@dataclass(frozen=True)
class ProduceFailed:
    """A produce request of a call the log process failed on (the others in the call are answered)."""
    message: str


@dataclass(frozen=True)
class Frame:
    """Any other request, as received."""
    client_host: str
    principal: str
    frame: bytes


@dataclass(frozen=True)
class Frames:
    """Requests one client connection sent, in its order, that the worker had
    not forwarded yet; answered with a FrameResult each."""
    frames: list[Frame]


@dataclass(frozen=True)
class FrameResult:
    response: bytes | None = None  # the response frame body, None when there is none (acks=0)
    violation: str | None = None  # the request broke the protocol: close the connection


@dataclass(frozen=True)
class OpenView:
    """Open a partition for Fetch (by name or topic id); answered with a
    PartitionSnapshot or a ViewRefused."""
    topic: str | None
    topic_id: bytes | None
    partition: int


@dataclass(frozen=True)
class PartitionSnapshot:
    topic: str
    topic_id: bytes
    hw: int
    log_start: int
    segments: list[SegmentManifest]
    cached: dict[str, CacheRef] = field(default_factory=dict)  # segment key -> where it is in the shared cache


@dataclass(frozen=True)
class ViewRefused:
    code: int
    message: str


@dataclass(frozen=True)
class GetUser:
    """A SASL user's stored credentials; answered with them or None."""
    name: str


# --------------------------------------------------------------------- events
@dataclass(frozen=True)
class AclsChanged:
    acls: list[bytes]  # AclBinding JSON each


class PartitionChanged(NamedTuple):
    """A partition log committed a segment (manifest), moved its start, or
    closed. Sent as a list (the changes of one pass of the log process's
    loop), each change as `sent()` makes it: a node commit makes one a slice
    for the workers viewing its partitions, a thousand at 1,000 partitions."""
    topic: str
    partition: int
    closed: bool
    hw: int
    log_start: int
    manifest: SegmentManifest | None
    ref: CacheRef | None

    @staticmethod
    def sent(topic: str, partition: int, closed: bool, hw: int, log_start: int, manifest: SegmentManifest | None,
             ref: CacheRef | None) -> SentChange:
        """A change as it crosses the socket: a plain tuple, its manifest as
        its fields. A list of named tuples pickles through Python code for
        each one (its class's __reduce_ex__ and __getnewargs__, its
        manifest's __reduce__): made and pickled, 1.86 us a change, 0.51 as
        plain tuples (bench/history.md, session 96)."""
        return topic, partition, closed, hw, log_start, None if manifest is None else manifest.fields(), ref

    @classmethod
    def received(cls, sent: SentChange) -> PartitionChanged:
        """The change `sent` made."""
        topic, partition, closed, hw, log_start, fields, ref = sent
        return cls(topic, partition, closed, hw, log_start, None if fields is None else SegmentManifest(*fields), ref)


SentChange = tuple[str, int, bool, int, int, tuple[Any, ...] | None, CacheRef | None]
