"""Optional features (Spark, replay, Iceberg) import their dependencies only
when used; a missing one is reported with what to install."""
from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(RuntimeError):
    """An optional dependency of the command being run is not installed."""


def load(module: str, command: str, extra: str = "spark") -> ModuleType:
    """Import `module` for `command`; MissingExtra names the pip extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingExtra(f"kafscale {command} needs {exc.name}, which a plain install leaves out: "
                           f"pip install 'kafscale[{extra}]'") from None
