"""Garbage-collector pauses: measured, and kept short.

A full (generation 2) collection scans every tracked object; after start-up the frontend holds
hundreds of thousands (modules, protobuf descriptors, grpc, SQLAlchemy, the model table), so an
untuned collection stalls the event loop for tens of milliseconds — every request in flight
waits, and under overload refusals stop being fast. :func:`settle` collects once and freezes
what start-up left alive (``gc.freeze``: never scanned again), so later collections only walk
objects made while serving. :class:`PauseWatch` records each pause and, outside the collector,
moves them into a histogram by generation (``inferplane_gc_pause_seconds``) for ``/metrics``.

The collector's callback only appends to a deque. It runs wherever a collection happens to start —
inside prometheus_client's own lock, while a metric child is being created — so touching a metric
from it deadlocks the process (seen with the multiprocess value store, whose lock is global).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import time


class PauseWatch:
    """Times every collection; :meth:`drain` (from ordinary code) observes them into the histogram."""

    def __init__(self, histogram) -> None:
        self._children = {g: histogram.labels(str(g)) for g in range(3)}
        self._pending: collections.deque[tuple[int, float]] = collections.deque()
        self._started: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._pending.append((info.get("generation", 2), time.perf_counter() - self._started))
            self._started = None

    def drain(self) -> int:
        n = 0
        while self._pending:
            generation, seconds = self._pending.popleft()
            self._children.get(generation, self._children[2]).observe(seconds)
            n += 1
        return n

    async def run(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            self.drain()

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self.drain()


def settle() -> None:
    """Collect once, then freeze everything alive (call when start-up is done)."""
    gc.collect()
    gc.freeze()
