"""Latency histogram: an HDR histogram in integer microseconds, mergeable across processes."""

from __future__ import annotations

from hdrh.histogram import HdrHistogram

# 1 µs .. 10 min, 3 significant digits (0.1% relative error at every value).
_LOWEST_US = 1
_HIGHEST_US = 600_000_000
_SIG_DIGITS = 3

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


def _label(p: float) -> str:
    return f"p{p:g}"


class LatencyHistogram:
    """Records latencies given in seconds; reports them in milliseconds."""

    __slots__ = ("_h", "_record")

    def __init__(self) -> None:
        self._h = HdrHistogram(_LOWEST_US, _HIGHEST_US, _SIG_DIGITS)
        self._record = self._h.record_value

    def record(self, seconds: float) -> None:
        us = int(seconds * 1e6)
        self._record(us if us >= _LOWEST_US else _LOWEST_US)

    def record_us(self, us: int) -> None:
        self._record(max(_LOWEST_US, min(int(us), _HIGHEST_US)))

    @property
    def count(self) -> int:
        return self._h.get_total_count()

    def percentile_ms(self, p: float) -> float:
        return self._h.get_value_at_percentile(p) / 1000.0

    def summary_ms(self, percentiles=PERCENTILES) -> dict[str, float]:
        """p50/p90/.../max/mean/min in milliseconds (zeros when empty)."""
        if self.count == 0:
            out = {_label(p): 0.0 for p in percentiles}
            out.update(max=0.0, mean=0.0, min=0.0)
            return out
        values = self._h.get_percentile_to_value_dict(list(percentiles))
        out = {_label(p): values[p] / 1000.0 for p in percentiles}
        out["max"] = self._h.get_max_value() / 1000.0
        out["mean"] = self._h.get_mean_value() / 1000.0
        out["min"] = self._h.get_min_value() / 1000.0
        return out

    def reset(self) -> None:
        self._h.reset()

    def add(self, other: "LatencyHistogram") -> None:
        self._h.add(other._h)

    def encode(self) -> bytes:
        return self._h.encode()

    @classmethod
    def decode(cls, data: bytes) -> "LatencyHistogram":
        out = cls()
        if data:
            out._h.decode_and_add(data)
        return out
