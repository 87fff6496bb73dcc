"""Garbage-collector pauses: measured, and kept short.

A full (generation 2) collection scans every tracked object; after start-up the frontend holds
hundreds of thousands (modules, protobuf descriptors, grpc, SQLAlchemy, the model table), so an
untuned collection stalls the event loop for tens of milliseconds — every request in flight
waits, and under overload refusals stop being fast. :func:`settle` collects once and freezes
what start-up left alive (``gc.freeze``: never scanned again), so later collections only walk
objects made while serving. :func:`watch` records each pause in a histogram by generation
(``inferplane_gc_pause_seconds``), so the effect is visible on ``/metrics``.
"""

from __future__ import annotations

import gc
import time

_started: list[float] = []


def watch(histogram) -> None:
    """Observe every collection's duration into ``histogram`` (labelled by generation)."""
    children = {g: histogram.labels(str(g)) for g in range(3)}

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            _started.append(time.perf_counter())
        elif _started:
            children.get(info.get("generation", 2), children[2]).observe(time.perf_counter() - _started.pop())

    gc.callbacks.append(callback)


def settle() -> None:
    """Collect once, then freeze everything alive (call when start-up is done)."""
    gc.collect()
    gc.freeze()
