"""Metering: in-memory sums, batched flushes, failures kept, usage and cost reports."""

import pytest

from server.tenancy.metering import Meter, parse_since, usage_report
from server.tenancy.store import TenancyStore


async def test_records_are_summed_and_flushed_in_one_batch(tmp_path):
    store = TenancyStore(f"sqlite:///{tmp_path}/m.db")
    now = [1000.0]
    meter = Meter(store.write_usage, clock=lambda: now[0])
    for _ in range(100):
        meter.record("a", "t1", "m1", "1", compute_us=10)
    meter.record("b", "t2", "m1", "1", input_tokens=7, output_tokens=3, compute_us=5)
    meter.record("b", "t2", "m1", "1", input_tokens=4, compute_us=5)  # an embedding: input only
    assert await meter.flush() == 2  # two rows for 102 requests
    assert await meter.flush() == 0
    assert store.usage("tenant") == [
        {"tenant": "a", "requests": 100, "input_tokens": 0, "output_tokens": 0, "tokens": 0, "compute_us": 1000},
        {"tenant": "b", "requests": 2, "input_tokens": 11, "output_tokens": 3, "tokens": 14, "compute_us": 10},
    ]


async def test_a_failed_write_keeps_the_sums_for_the_next_flush():
    calls = []

    def flaky(records):
        calls.append(records)
        if len(calls) == 1:
            raise OSError("database is away")
        return len(records)

    meter = Meter(flaky)
    meter.record("a", "t", "m", "1", input_tokens=5, output_tokens=2)
    assert await meter.flush() == 0 and meter.failures == 1
    meter.record("a", "t", "m", "1", input_tokens=1, output_tokens=1)
    assert await meter.flush() == 1
    kept = calls[1][0]
    assert (kept.requests, kept.input_tokens, kept.output_tokens, kept.tokens) == (2, 6, 3, 9)


async def test_stop_flushes_what_is_left(tmp_path):
    store = TenancyStore(f"sqlite:///{tmp_path}/s.db")
    meter = Meter(store.write_usage, flush_s=3600)
    meter.start()
    meter.record("a", "t", "m", "1")
    await meter.stop()
    assert store.usage("model")[0]["requests"] == 1


def test_since_parsing():
    assert parse_since("1h", now=10_000) == 10_000 - 3600
    assert parse_since("30m", now=10_000) == 10_000 - 1800
    assert parse_since("1700000000") == 1_700_000_000
    assert parse_since("2024-01-01") == 1704067200.0


def test_usage_reports(tmp_path):
    store = TenancyStore(f"sqlite:///{tmp_path}/c.db")
    meter = Meter(store.write_usage)
    meter.record("a", "ml", "gpu_model", "1", compute_us=3_600_000_000)  # one hour
    meter.record("a", "ml", "tree", "1", compute_us=1_800_000_000)
    meter.record("b", "ads", "tree", "1", compute_us=3_600_000_000)
    store.write_usage(meter.drain())
    assert usage_report(store, "team", 0)[0] == {
        "team": "ads", "requests": 1, "input_tokens": 0, "output_tokens": 0, "tokens": 0, "compute_s": 3600.0,
    }  # fmt: skip
