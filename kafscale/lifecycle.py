"""Stopping an asyncio process on SIGINT or SIGTERM."""
from __future__ import annotations

import asyncio
import signal


def stop_on_signals(once: bool = False) -> asyncio.Event:
    """An event set by SIGINT or SIGTERM. With once, the first signal also
    puts the default handlers back: a second Ctrl-C stops at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stopping() -> None:
        stop.set()
        if once:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping)
    return stop
