"""Processors: jobs that read segments straight from S3, never from a broker.
Their command-line parsers live here, so that `kafscale` starts without the
optional dependencies a processor needs (pyarrow, pyiceberg, PyYAML)."""
from __future__ import annotations

import argparse
from typing import Any

from kafscale import config as config_mod
from kafscale import extras


def add_parser(sub: Any) -> None:
    p = sub.add_parser("processor", help="processors that read segments from S3 (no broker)")
    kinds = p.add_subparsers(dest="kind", required=True)
    ice = kinds.add_parser("iceberg", help="materialize a topic into an Apache Iceberg table (at-least-once)")
    ice.add_argument("--topic", required=True)
    ice.add_argument("--table", required=True, help="namespace.table")
    ice.add_argument("--catalog", default="sqlite:///kafscale-iceberg.db",
                     help="SQL catalog URI (default sqlite:///kafscale-iceberg.db) or a REST catalog http(s) URL")
    ice.add_argument("--warehouse", help="where data files go (default s3://BUCKET/iceberg)")
    ice.add_argument("--mapping", help="YAML mapping JSON value fields to columns")
    ice.add_argument("--interval", type=float, default=5.0, help="seconds between passes (default 5)")
    ice.add_argument("--max-records", type=int, default=500_000, help="records per Iceberg commit (default 500000)")
    ice.add_argument("--once", action="store_true", help="materialize what is there now, then exit")
    config_mod.add_arguments(ice, only=config_mod.STORE_FIELDS)
    ice.set_defaults(func=_run_iceberg)


def _run_iceberg(args: argparse.Namespace) -> int:
    for dep in ("pyarrow", "yaml", "pyiceberg"):
        extras.load(dep, "processor iceberg")
    run: Any = extras.load("kafscale.processors.iceberg", "processor iceberg").run
    return int(run(args))
