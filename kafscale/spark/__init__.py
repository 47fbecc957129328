"""Spark over KafScale segments: a data source and the replay job."""
from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Make spark.read.format("kafscale") available in this Spark session."""
    from kafscale.spark.source import KafScaleDataSource

    spark.dataSource.register(KafScaleDataSource)
