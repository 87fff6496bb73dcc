"""What every long-running inferplane process (``serve``, its workers, ``control run``, ``reconcile``,
``dev cluster``) does the same way: its log lines' one format (``log_to_stderr``) and the stop that
SIGINT or SIGTERM asks for (``stop_on_signals``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)


def stop_on_signals() -> asyncio.Event:
    """An event SIGINT or SIGTERM sets, on the running loop (the process then stops in its own order)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
