"""Open-loop arrival schedules: offsets (seconds from the start) at which requests are due.

Pure and clock-free so they can be tested without a network. Latency in open loop is counted
from these scheduled times, not from when the request actually left, so a stalled client or
server shows up in the numbers instead of silently lowering the offered load (coordinated
omission).
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def arrival_offsets(
    rate: float,
    *,
    poisson: bool = False,
    seed: int | None = None,
    phase: float = 0.0,
) -> Iterator[float]:
    """Endless, increasing offsets for `rate` arrivals per second.

    Fixed rate: phase, phase + 1/rate, phase + 2/rate, ...  (computed by multiplication, so
    no floating-point drift accumulates). Poisson: exponential gaps with mean 1/rate.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if poisson:
        rng = random.Random(seed)
        expovariate = rng.expovariate
        t = phase
        while True:
            t += expovariate(rate)
            yield t
    else:
        interval = 1.0 / rate
        i = 0
        while True:
            yield phase + i * interval
            i += 1


def split_rate(rate: float, parts: int, index: int, poisson: bool) -> tuple[float, float]:
    """(rate, phase) for worker `index` of `parts` so the workers together offer `rate`.

    Fixed-rate workers interleave: worker i starts at i/rate and each runs at rate/parts.
    Poisson streams superpose into a Poisson stream, so they need no phase.
    """
    share = rate / parts
    phase = 0.0 if poisson else index / rate
    return share, phase
