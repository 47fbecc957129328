"""Vocabulary shared by the broker, the tools and the readers."""
from __future__ import annotations

from typing import NamedTuple


class TopicPartition(NamedTuple):
    """A partition of a topic. A tuple, so `(topic, p)` keys and it are interchangeable."""
    topic: str
    partition: int


# ListOffsets' special timestamps (and Spark's startingOffsets/endingOffsets)
LATEST = -1  # the high watermark: the offset the next record gets
EARLIEST = -2  # the log start offset
MAX_TIMESTAMP = -3  # (ListOffsets v7+) the record with the largest timestamp
EARLIEST_LOCAL = -4  # (v8+) the first offset on the broker's own storage: here the log start
LATEST_TIERED = -5  # (v9+) the last offset in remote storage: here the last committed record
