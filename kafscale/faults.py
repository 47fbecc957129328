"""Crash points for the crash tests: with KAFSCALE_CRASH_AT=POINT:N in its
environment, the log process SIGKILLs its whole node (supervisor, itself and
the workers: their process group, as `kill -9` of a pod would) the N-th time
it reaches POINT. Unset (always, outside tests), reached() is one comparison.

Points: before-upload (a node object is built, not uploaded), after-upload
(uploaded, not committed), after-commit (committed, its producers not
acknowledged), mid-compaction (a compacted segment uploaded, its manifest not
committed)."""
from __future__ import annotations

import os
import signal

POINTS = ("before-upload", "after-upload", "after-commit", "mid-compaction")


def _parse(spec: str) -> tuple[str, int]:
    point, _, n = spec.partition(":")
    if point not in POINTS:
        raise ValueError(f"KAFSCALE_CRASH_AT={spec!r}: the point must be one of {', '.join(POINTS)}")
    return point, int(n or 1)


_point, _left = _parse(os.environ["KAFSCALE_CRASH_AT"]) if os.environ.get("KAFSCALE_CRASH_AT") else ("", 0)


def reached(point: str) -> None:
    global _left
    if point != _point:
        return
    _left -= 1
    if _left == 0:
        os.killpg(os.getpgrp(), signal.SIGKILL)
