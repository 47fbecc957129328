"""Broker configuration: one dataclass, filled from a TOML file, then
`KAFSCALE_*` environment variables, then command-line flags (later wins)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import ssl
import tomllib
from dataclasses import dataclass, field
from typing import Any

from kafscale.security.sasl import MECHANISMS


class ConfigError(ValueError):
    """A setting is unknown or has an unusable value."""


_SOCKOPT_INT_MAX = 2**31 - 1  # setsockopt takes a C int


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    node_id: int = _opt(1, "broker id reported in Metadata")
    listen: str = _opt("0.0.0.0:9092", "host:port the Kafka listener binds")
    advertised: str = _opt("", "host:port clients should connect to (default: listen, 0.0.0.0 -> 127.0.0.1)")
    admin_listen: str = _opt("", "host:port of the HTTP admin endpoint: /metrics, /healthz, /readyz (empty: off)")
    tls_cert: str = _opt("", "PEM certificate (chain) of the Kafka listener: set it and the key to speak TLS")
    tls_key: str = _opt("", "PEM private key of tls_cert")
    tls_client_ca: str = _opt("", "PEM CA bundle: require client certificates signed by it (mutual TLS)")
    proxy_upstream_timeout_s: int = _opt(10, "proxy: how long a broker may take to answer beyond the wait the "
                                         "request itself asks for (max_wait_ms, timeout_ms, rebalance timeout)")
    tls_broker_ca: str = _opt("", "proxy: connect to the brokers over TLS, trusting this PEM CA bundle")
    sasl_mechanisms: str = _opt("", "comma-separated SASL mechanisms the Kafka listener requires: PLAIN, "
                                "SCRAM-SHA-256, SCRAM-SHA-512 (empty: no SASL); users: kafscale users add")
    proxy_secret: str = _opt("", "shared by the brokers and proxies of a cluster: lets a proxy speak for each "
                             "client (its SASL principal and address reach the brokers' ACLs); empty: off")
    authorizer: bool = _opt(False, "enforce ACLs (kept in etcd; kafscale acls or Kafka's CreateAcls/DeleteAcls)")
    super_users: str = _opt("", "principals that bypass ACLs, separated by ';' (e.g. User:admin)")
    allow_everyone_if_no_acl_found: bool = _opt(False, "with the authorizer: allow access to resources that no "
                                                "ACL names (default: deny)")
    etcd: str = _opt("127.0.0.1:2379", "etcd endpoints host:port[,host:port...] (the first that answers is used)")
    etcd_user: str = _opt("", "etcd user (etcd authentication; empty: none)")
    etcd_password: str = _opt("", "password of etcd_user")
    etcd_ca: str = _opt("", "PEM CA bundle: speak TLS to etcd, trusting its certificate by this CA")
    etcd_cert: str = _opt("", "with etcd_ca: PEM client certificate to present to etcd (mutual TLS)")
    etcd_key: str = _opt("", "PEM private key of etcd_cert")
    cluster: str = _opt("default", "cluster name: etcd key prefix /kafscale/{cluster}/")
    s3_endpoint: str = _opt("", "S3 endpoint URL (empty: AWS default)")
    s3_region: str = _opt("us-east-1", "S3 region")
    s3_access_key: str = _opt("", "S3 access key (empty: the usual AWS credential chain)")
    s3_secret_key: str = _opt("", "S3 secret key")
    bucket: str = _opt("kafscale", "S3 bucket for segments")
    namespace: str = _opt("kafscale", "key prefix inside the bucket")
    auto_create_topics: bool = _opt(False, "create unknown topics on Metadata/Produce")
    default_partitions: int = _opt(1, "partitions for auto-created topics and CreateTopics with -1")
    linger_ms: int = _opt(5, "how long batches gather before a node object (node_flush off: a partition's "
                          "segment) is cut while one cut before is still uploading or committing; with none "
                          "under way a batch goes at once")
    segment_bytes: int = _opt(16 * 1024 * 1024, "largest segment a flush builds")
    node_flush: bool = _opt(True, "one object per flush cycle for all of a node's partitions, compacted into "
                            "per-partition segments later (see docs/architecture.md)")
    flush_bytes: int = _opt(8 * 1024 * 1024, "node flush: a node object is written once this much is queued "
                            "(else after linger_ms)")
    compaction_lag_ms: int = _opt(10_000, "node flush: a partition's node object slices are compacted into a "
                                  "segment once the oldest is this old (or they reach segment.bytes); three "
                                  "times this while they hold less than 64 KiB; sooner while the segment cache "
                                  "keeps slices for less than three times either")
    shared_compaction: bool = _opt(True, "node flush: small partitions due together are compacted into one "
                                   "shared object (one PUT and one etcd transaction for up to 42), merging "
                                   "their small segments, instead of one .kfs each")
    multipart_threshold: int = _opt(16 * 1024 * 1024, "segments above this size upload as multipart")
    cache_bytes: int = _opt(1024 * 1024 * 1024, "shared-memory cache of recent segments that workers serve Fetch "
                            "from and compaction reads slices from")
    s3_timeout_s: int = _opt(30, "longest one attempt at uploading a segment may take before it is retried")
    readahead_bytes: int = _opt(16 * 1024 * 1024, "size of each ranged S3 GET (and read-ahead) for uncached segments")
    readahead_memory_bytes: int = _opt(128 * 1024 * 1024, "S3 read-ahead memory per process, across all the "
                                       "partitions it reads; when short, windows shrink and read-ahead waits")
    fetch_session_slots: int = _opt(1000, "incremental fetch sessions (KIP-227) each protocol worker keeps, as "
                                    "Kafka's max.incremental.fetch.session.cache.slots (0: none; a consumer then "
                                    "names every partition in each Fetch and gets every one back)")
    workers: int = _opt(0, "protocol worker processes (0: one per CPU core)")
    ring_bytes: int = _opt(64 * 1024 * 1024, "shared-memory produce buffer per worker; when full, produce gets "
                           "a retriable error (backpressure)")
    max_request_bytes: int = _opt(100 * 1024 * 1024, "largest request frame accepted (before SASL "
                                  "authentication: 512 KiB)")
    queued_max_request_bytes: int = _opt(256 * 1024 * 1024, "request bytes a protocol worker (or the proxy) "
                                         "holds at once across its connections; reading waits beyond it")
    max_in_flight_requests: int = _opt(1000, "requests of one connection read and not yet answered; beyond it "
                                       "the connection is not read (librdkafka sends one produce request per "
                                       "partition batch and pipelines them: keep it above produce requests/s x "
                                       "ack latency; every request read waits ahead of other clients' ones)")
    read_pacing_ms: int = _opt(2, "a connection that pipelines small Produce requests less than twice this apart "
                               "is read at most once every this long (at most linger_ms), its requests waiting "
                               "in the socket meanwhile: a worker and its log process wake once for several of "
                               "them, not once each (0: read each as it comes)")
    socket_receive_buffer_bytes: int = _opt(100 * 1024, "SO_RCVBUF of each client connection, as Kafka's "
                                            "socket.receive.buffer.bytes (-1: the system's, which grows to "
                                            "net.ipv4.tcp_rmem's maximum): what a client can send past a "
                                            "connection the broker has stopped reading")
    request_read_timeout_s: int = _opt(30, "a request frame must arrive whole within this many seconds of its "
                                       "size prefix, or the connection is closed")
    response_write_timeout_s: int = _opt(60, "a client that takes no bytes of a response for this many seconds "
                                         "is disconnected (frees what the response holds)")
    connections_max_idle_ms: int = _opt(600_000, "a connection with no request for this long, and none pending, "
                                        "is closed (Kafka's connections.max.idle.ms)")
    max_message_bytes: int = _opt(1024 * 1024 + 1024, "largest record batch accepted (max.message.bytes)")
    lease_ttl_s: int = _opt(6, "etcd lease TTL: a dead broker's partitions move after about this long")
    balance_interval_ms: int = _opt(2000, "how often a broker re-reads membership and hands partitions over")
    retention_check_ms: int = _opt(60_000, "how often partitions are checked against retention.ms/bytes")
    delete_delay_ms: int = _opt(60_000, "an object compaction or retention left unnamed (a node object "
                                "compacted away, a shared object whose segments are all gone) is deleted "
                                "this long after, so reads in flight finish (Kafka's file.delete.delay.ms)")
    etcd_compaction_ms: int = _opt(60_000, "how often one broker of the cluster compacts etcd's history up to "
                                   "the revision it saw at its previous pass (etcd keeps every version of "
                                   "every key until then, and refuses writes at its quota); 0: never, for an "
                                   "etcd that compacts itself (--auto-compaction-retention)")
    group_initial_rebalance_delay_ms: int = _opt(500, "how long a new group waits for more members to join")
    validate_compressed: bool = _opt(True, "decompress compressed batches on produce to validate their records")
    max_uncompressed_batch_bytes: int = _opt(64 * 1024 * 1024, "largest a compressed batch may decompress to on "
                                             "produce (MESSAGE_TOO_LARGE beyond): bounds compression bombs")
    log_level: str = _opt("INFO", "logging level")

    def server_ssl(self) -> ssl.SSLContext | None:
        """The Kafka listener's TLS context (None: plaintext)."""
        if not self.tls_cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.tls_cert, self.tls_key or None)
        if self.tls_client_ca:
            ctx.load_verify_locations(self.tls_client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def __post_init__(self) -> None:
        self.sasl_mechanism_list()
        rcvbuf = self.socket_receive_buffer_bytes
        if rcvbuf != -1 and not 0 < rcvbuf <= _SOCKOPT_INT_MAX:
            raise ConfigError(f"socket_receive_buffer_bytes must be -1 (the system's) or 1..{_SOCKOPT_INT_MAX} "
                              f"bytes, not {rcvbuf}")

    def sasl_mechanism_list(self) -> tuple[str, ...]:
        mechs = tuple(m.strip().upper() for m in self.sasl_mechanisms.split(",") if m.strip())
        unknown = [m for m in mechs if m not in MECHANISMS]
        if unknown:
            raise ConfigError(f"unsupported SASL mechanisms {unknown}: choose from {', '.join(MECHANISMS)}")
        return mechs

    def broker_ssl(self) -> ssl.SSLContext | None:
        """How the proxy connects to brokers (None: plaintext)."""
        if not self.tls_broker_ca:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_broker_ca)
        if self.tls_cert:  # present our own certificate too, for brokers that require one
            ctx.load_cert_chain(self.tls_cert, self.tls_key or None)
        return ctx

    def listen_addr(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "0.0.0.0", int(port)

    def advertised_addr(self) -> tuple[str, int]:
        if self.advertised:
            host, _, port = self.advertised.rpartition(":")
            return host, int(port)
        host, port = self.listen_addr()
        return ("127.0.0.1" if host in ("0.0.0.0", "", "::") else host), port


def _convert(f: dataclasses.Field, raw: Any) -> Any:
    if f.type in ("bool", bool):
        return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
    if f.type in ("int", int):
        return int(raw)
    return str(raw)


STORE_FIELDS = ("etcd", "etcd_user", "etcd_password", "etcd_ca", "etcd_cert", "etcd_key", "cluster", "s3_endpoint",
                "s3_region", "s3_access_key", "s3_secret_key", "bucket", "namespace")


def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                  only: tuple[str, ...] | None = None) -> None:
    """One flag per Config field: --node-id, --s3-endpoint, ... (defaults None so
    that unset flags do not override the file or the environment); with
    `only`, just those fields (STORE_FIELDS: where the data is)."""
    parser.add_argument("--config", help="TOML file with Config fields")
    for f in dataclasses.fields(Config):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{f.metadata['help']} (env KAFSCALE_{f.name.upper()})")
        else:
            parser.add_argument(flag, default=None, help=f"{f.metadata['help']} (default {f.default!r}; "
                                                         f"env KAFSCALE_{f.name.upper()})")


def load(args: argparse.Namespace | None = None, environ: dict[str, str] | None = None, **overrides: Any) -> Config:
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = getattr(args, "config", None) if args is not None else None
    if path:
        with open(path, "rb") as fh:
            values.update(tomllib.load(fh))
    fields = {f.name: f for f in dataclasses.fields(Config)}
    unknown = set(values) - set(fields)
    if unknown:
        raise ConfigError(f"unknown configuration keys: {sorted(unknown)}")
    for name in fields:
        env = environ.get(f"KAFSCALE_{name.upper()}")
        if env is not None:
            values[name] = env
        if args is not None and getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    values.update(overrides)
    return Config(**{n: _convert(fields[n], v) for n, v in values.items()})
