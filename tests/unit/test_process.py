"""server.runtime.process: the stop a long-running process's signals ask for, and its log format."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from server.runtime import process


async def test_sigterm_and_sigint_set_the_stop_event():
    for sig in (signal.SIGTERM, signal.SIGINT):
        stop = process.stop_on_signals()
        assert not stop.is_set()
        os.kill(os.getpid(), sig)  # a real signal, delivered to this loop's handler
        await asyncio.wait_for(stop.wait(), 10)
        assert stop.is_set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


def test_log_lines_have_the_one_format(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    process.log_to_stderr("warning")
    assert root.level == logging.WARNING
    assert [h.formatter._fmt for h in root.handlers] == [process.LOG_FORMAT]
