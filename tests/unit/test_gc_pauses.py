import gc

from prometheus_client import CollectorRegistry, Histogram

from server.runtime import gc_pauses


def test_every_collection_is_observed_by_generation():
    registry = CollectorRegistry()
    histogram = Histogram("pauses", "gc pauses", ("generation",), registry=registry)
    watch = gc_pauses.PauseWatch(histogram)
    try:
        gc.collect(0)
        gc.collect(2)
        assert watch.drain() >= 2
        assert registry.get_sample_value("pauses_count", {"generation": "0"}) >= 1
        assert registry.get_sample_value("pauses_count", {"generation": "2"}) >= 1
        assert registry.get_sample_value("pauses_sum", {"generation": "2"}) > 0
    finally:
        watch.close()


def test_the_collector_callback_never_touches_the_metric():
    # a collection can start inside prometheus_client's lock; observing there deadlocks the process
    class Exploding:
        def labels(self, generation):
            return self

        def observe(self, seconds):
            raise AssertionError("observed from inside the garbage collector")

    watch = gc_pauses.PauseWatch(Exploding())
    try:
        gc.collect(0)  # the callback runs here and must only record
        assert len(watch._pending) >= 1
    finally:
        gc.callbacks.remove(watch._callback)


def test_settle_freezes_what_is_alive():
    keep = [object() for _ in range(1000)]
    try:
        gc_pauses.settle()
        assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()
