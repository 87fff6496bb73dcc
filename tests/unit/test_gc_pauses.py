import gc

from prometheus_client import CollectorRegistry, Histogram

from server.runtime import gc_pauses


def test_every_collection_is_observed_by_generation():
    registry = CollectorRegistry()
    histogram = Histogram("pauses", "gc pauses", ("generation",), registry=registry)
    before = len(gc.callbacks)
    gc_pauses.watch(histogram)
    try:
        gc.collect(0)
        gc.collect(2)
        assert registry.get_sample_value("pauses_count", {"generation": "0"}) >= 1
        assert registry.get_sample_value("pauses_count", {"generation": "2"}) >= 1
        assert registry.get_sample_value("pauses_sum", {"generation": "2"}) > 0
    finally:
        del gc.callbacks[before:]


def test_settle_freezes_what_is_alive():
    keep = [object() for _ in range(1000)]
    try:
        gc_pauses.settle()
        assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()
