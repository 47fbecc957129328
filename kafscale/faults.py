"""Crash points for the crash tests: with KAFSCALE_CRASH_AT=POINT:N in its
environment, the log process SIGKILLs its whole node (supervisor, itself and
the workers: their process group, as `kill -9` of a pod would) the N-th time
it reaches POINT. Unset (always, outside tests), reached() is one comparison.

Points: before-upload (a node object is built, not uploaded), after-upload
(uploaded, not committed), after-commit (committed, its producers not
acknowledged), mid-compaction (a compacted segment uploaded, its manifest not
committed).

With KAFSCALE_DELAY_AT=POINT:N:SECONDS the N-th time the log process reaches
POINT that coroutine waits SECONDS there (the rest of the process runs on);
the one point is before-commit (a node object uploaded, its commit about to
be sent), where a test takes the broker's lease away."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger(__name__)

POINTS = ("before-upload", "after-upload", "after-commit", "mid-compaction")
DELAY_POINTS = ("before-commit",)


def _parse(var: str, points: tuple[str, ...]) -> tuple[str, int, float]:
    spec = os.environ.get(var)
    if not spec:
        return "", 0, 0.0
    point, _, rest = spec.partition(":")
    if point not in points:
        raise ValueError(f"{var}={spec!r}: the point must be one of {', '.join(points)}")
    n, _, seconds = rest.partition(":")
    return point, int(n or 1), float(seconds or 0)


_point, _left, _ = _parse("KAFSCALE_CRASH_AT", POINTS)
_delay_point, _delay_left, _delay_s = _parse("KAFSCALE_DELAY_AT", DELAY_POINTS)


def reached(point: str) -> None:
    global _left
    if point != _point:
        return
    _left -= 1
    if _left == 0:
        os.killpg(os.getpgrp(), signal.SIGKILL)


async def delay(point: str) -> None:
    global _delay_left
    if point != _delay_point:
        return
    _delay_left -= 1
    if _delay_left == 0:
        log.warning("fault: waiting %.1f s at %s", _delay_s, point)
        await asyncio.sleep(_delay_s)
        log.warning("fault: done waiting at %s", point)
