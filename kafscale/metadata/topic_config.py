"""The topic configurations KafScale accepts, their defaults and validation.

Anything else (or a value KafScale cannot honour, such as compaction) is
refused with INVALID_CONFIG rather than silently stored."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from kafscale.config import Config

# DescribeConfigs config_type values
BOOLEAN, STRING, INT, SHORT, LONG, DOUBLE, LIST = 1, 2, 3, 4, 5, 6, 7

WEEK_MS = 7 * 24 * 3600 * 1000


def _int_at_least(lo: int) -> Callable[[str], str | None]:
    def check(v: str) -> str | None:
        try:
            return None if int(v) >= lo else f"must be >= {lo}"
        except ValueError:
            return "must be an integer"
    return check


def _one_of(*allowed: str) -> Callable[[str], str | None]:
    def check(v: str) -> str | None:
        return None if v in allowed else f"supported values: {', '.join(allowed)}"
    return check


@dataclass(frozen=True)
class ConfigDef:
    name: str
    type: int
    default: Callable[[Config], str]
    check: Callable[[str], str | None]
    doc: str


TOPIC_CONFIGS: dict[str, ConfigDef] = {d.name: d for d in (
    ConfigDef("retention.ms", LONG, lambda c: str(WEEK_MS), _int_at_least(-1),
              "delete segments whose newest record is older than this (-1: keep forever)"),
    ConfigDef("retention.bytes", LONG, lambda c: "-1", _int_at_least(-1),
              "delete the oldest segments while a partition holds more than this (-1: no limit)"),
    ConfigDef("segment.bytes", INT, lambda c: str(c.segment_bytes), _int_at_least(1024),
              "largest segment object a flush builds"),
    ConfigDef("max.message.bytes", INT, lambda c: str(c.max_message_bytes), _int_at_least(0),
              "largest record batch accepted"),
    ConfigDef("segment.ms", LONG, lambda c: str(WEEK_MS), _int_at_least(1),
              "accepted for compatibility; segments are flushed on linger_ms"),
    ConfigDef("cleanup.policy", LIST, lambda c: "delete", _one_of("delete"),
              "only delete: compaction is not supported"),
    ConfigDef("message.timestamp.type", STRING, lambda c: "CreateTime", _one_of("CreateTime"),
              "producers' timestamps are kept (CreateTime)"),
    ConfigDef("min.insync.replicas", INT, lambda c: "1", _int_at_least(1),
              "accepted for compatibility; S3 provides the durability"),
    ConfigDef("compression.type", STRING, lambda c: "producer",
              lambda v: None if v == "producer" else "KafScale stores batches as producers compressed them and does "
              "not recompress; set compression.type on the producer instead",
              "batches are stored as the producer compressed them"),
    ConfigDef("message.format.version", STRING, lambda c: "3.0-IV1", lambda v: None,
              "deprecated in Kafka 3; accepted and ignored as Kafka 3 does (batches are always v2)"),
)}


def validate(configs: dict[str, str | None]) -> str | None:
    """An error message for the first unacceptable config, else None."""
    for name, value in configs.items():
        d = TOPIC_CONFIGS.get(name)
        if d is None:
            return f"unsupported topic config {name!r}"
        if value is None:
            return f"{name} needs a value"
        err = d.check(value)
        if err:
            return f"{name}={value!r}: {err}"
    return None


# The broker settings IncrementalAlterConfigs may change at run time, cluster-wide
# (stored in etcd): each the default of a topic config, or of new topics' size.
BROKER_TOPIC_DEFAULTS = {"log.retention.ms": "retention.ms", "log.retention.bytes": "retention.bytes",
                         "log.segment.bytes": "segment.bytes", "message.max.bytes": "max.message.bytes"}
NUM_PARTITIONS = "num.partitions"
DYNAMIC_BROKER_CONFIGS = {**{b: TOPIC_CONFIGS[t] for b, t in BROKER_TOPIC_DEFAULTS.items()},
                          NUM_PARTITIONS: ConfigDef(NUM_PARTITIONS, INT, lambda c: str(c.default_partitions),
                                                    _int_at_least(1), "partitions of a topic created without a count")}


def broker_config_error(name: str, value: str | None) -> str | None:
    """Why a broker config cannot be set to value at run time, or None."""
    d = DYNAMIC_BROKER_CONFIGS.get(name)
    if d is None:
        return (f"{name} cannot be changed at run time; dynamic broker configs are "
                f"{', '.join(sorted(DYNAMIC_BROKER_CONFIGS))}")
    if value is None:
        return f"{name} needs a value"
    err = d.check(value)
    return f"{name}={value!r}: {err}" if err else None


@dataclass
class Defaults:
    """What a topic that does not set a config gets: the broker's settings,
    overridden cluster-wide by the dynamic broker configs in etcd."""
    cfg: Config
    dynamic: dict[str, str] = field(default_factory=dict)

    def broker(self, name: str) -> str:
        """A dynamic broker config's current value."""
        return self.dynamic.get(name) or DYNAMIC_BROKER_CONFIGS[name].default(self.cfg)

    def topic(self, name: str) -> str:
        for broker_name, topic_name in BROKER_TOPIC_DEFAULTS.items():
            if topic_name == name:
                return self.broker(broker_name)
        return TOPIC_CONFIGS[name].default(self.cfg)

    @property
    def partitions(self) -> int:
        return int(self.broker(NUM_PARTITIONS))


def effective(configs: dict[str, str], defaults: Defaults) -> dict[str, tuple[str, bool]]:
    """Every topic config with its value and whether that is the default."""
    return {name: (configs[name], False) if name in configs else (defaults.topic(name), True)
            for name in TOPIC_CONFIGS}


def value(configs: dict[str, str], name: str, defaults: Defaults) -> int:
    return int(configs.get(name) or defaults.topic(name))


_TOPIC_RE = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")


def topic_name_error(name: str) -> str | None:
    """Why Kafka would refuse this topic name, or None."""
    if not _TOPIC_RE.match(name) or name in (".", ".."):
        return "topic names are 1-249 characters of [a-zA-Z0-9._-], not '.' or '..'"
    return None
