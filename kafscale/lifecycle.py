"""Telling the supervisor a process has started; stopping an asyncio process
on SIGINT or SIGTERM."""
from __future__ import annotations

import asyncio
import gc
import os
import signal


def started(ready_fd: int) -> None:
    """Write the one byte that tells the supervisor a child process is up, first
    freezing what its start created (modules imported, S3 service models,
    connections): Python's cyclic collector never scans those again, so a
    full collection costs what the process holds for its work, not that too."""
    gc.collect()
    gc.freeze()
    os.write(ready_fd, b"1")
    os.close(ready_fd)


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
