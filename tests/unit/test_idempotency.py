"""Idempotency keys: replay, conflicts, concurrent duplicates run once, TTL; memory and Redis stores
(``redis_url``: a real redis-server, tests/conftest.py)."""

import asyncio
import struct

import pytest

from server.dataplane.builder import build_dataplane
from server.dataplane.idempotency import MemoryIdempotency, RedisIdempotency, body_digest, scoped
from server.dataplane.metrics import Metrics
from server.dataplane.signature import ModelSignature, TensorSpec
from server.errors import BackendError, BackendUnavailable, DeadlineExceeded, IdempotencyKeyReused
from server.protogen.inference import grpc_service_pb2 as pb
from server.settings import Settings
from server.tenancy.identity import CallContext, Gatekeeper, KeyEntry, KeyRing, Tenant, hash_key, new_key
from tests.backend_fake import FakeBackend


class Counter:
    def __init__(self, delay=0.0, fail_first=0):
        self.calls = 0
        self.delay = delay
        self.fail_first = fail_first

    async def __call__(self):
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.calls <= self.fail_first:
            raise BackendError("boom")
        return b"answer-%d" % self.calls


async def _contract(store):
    key, d1, d2 = scoped("t", "k1"), body_digest(b"body-1"), body_digest(b"body-2")
    fn = Counter(delay=0.05)
    results = await asyncio.gather(*(store.run(key, d1, fn) for _ in range(8)))
    assert results == [b"answer-1"] * 8 and fn.calls == 1
    assert await store.run(key, d1, fn) == b"answer-1" and fn.calls == 1
    with pytest.raises(IdempotencyKeyReused, match="'k1'"):
        await store.run(key, d2, fn)
    # another tenant's identical key is another key
    assert await store.run(scoped("u", "k1"), d2, fn) == b"answer-2"

    # a failed first run is not stored: a waiting duplicate runs in its place
    flaky = Counter(delay=0.05, fail_first=1)
    key2 = scoped("t", "k2")
    outcome = await asyncio.gather(store.run(key2, d1, flaky), store.run(key2, d1, flaky), return_exceptions=True)
    assert isinstance(outcome[0], BackendError) and outcome[1] == b"answer-2" and flaky.calls == 2
    assert await store.run(key2, d1, flaky) == b"answer-2"

    # a cancelled first run frees the key
    slow = Counter(delay=10)
    task = asyncio.create_task(store.run(scoped("t", "k3"), d1, slow))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.run(scoped("t", "k3"), d1, Counter()) == b"answer-1"


async def test_memory_store_contract():
    await _contract(MemoryIdempotency())


async def test_memory_store_ttl_and_size_bound():
    now = [0.0]
    store = MemoryIdempotency(ttl_s=10, max_entries=2, clock=lambda: now[0])
    fn = Counter()
    d = body_digest(b"x")
    await store.run("a", d, fn)
    now[0] = 9.9
    assert await store.run("a", d, fn) == b"answer-1"
    now[0] = 10.0
    assert await store.run("a", d, fn) == b"answer-2"  # expired: runs again
    await store.run("b", d, fn)
    await store.run("c", d, fn)
    assert len(store._entries) <= 3
    await store.run("d", d, fn)
    assert "a" not in store._entries and len(store._entries) <= 3


async def test_redis_store_contract(redis_url):
    store = RedisIdempotency(redis_url, poll_s=0.002)
    try:
        await store.client.flushdb()
        await _contract(store)
        # two stores (two frontend processes) share the keys
        other = RedisIdempotency(redis_url)
        try:
            assert await other.run(scoped("t", "k1"), body_digest(b"body-1"), Counter()) == b"answer-1"
        finally:
            await other.close()
    finally:
        await store.close()


async def test_redis_store_ttl(redis_url):
    store = RedisIdempotency(redis_url, ttl_s=0.2)
    try:
        fn = Counter()
        d = body_digest(b"x")
        await store.run("ttl", d, fn)
        assert await store.run("ttl", d, fn) == b"answer-1"
        await asyncio.sleep(0.3)
        assert await store.run("ttl", d, fn) == b"answer-2"
    finally:
        await store.close()


def _echo(backend: FakeBackend):
    """Answers each call with its input bytes and a run number: two answers are told apart by both."""

    def answer(raw: bytes) -> bytes:
        parsed = pb.ModelInferRequest.FromString(raw)
        response = pb.ModelInferResponse(model_name=parsed.model_name, id=f"run-{backend.calls}")
        response.outputs.add(name="y", datatype="FP32", shape=[1, 4])
        response.raw_output_contents.append(parsed.raw_input_contents[0])
        return response.SerializeToString()

    return answer


def _infer_request(value: float) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(struct.pack("<4f", value, value, value, value))
    return request


async def test_the_same_idempotency_key_from_two_tenants_is_two_keys():
    """acme and globex both send key "order-1" with different bodies: each gets the answer to its own
    body, never the other's stored one (and neither is refused as a reused key)."""
    ring = KeyRing(b"pepper")
    keys = {name: new_key()[1] for name in ("acme", "globex")}
    ring.load([Tenant(name) for name in keys], [KeyEntry(f"{name:8.8}", hash_key(key, b"pepper"), name) for name, key in keys.items()])
    backend = FakeBackend("echo:1", ["m"])
    backend.answer = _echo(backend)
    dp = build_dataplane(Settings(), backend, metrics=Metrics(), gate=Gatekeeper(ring))
    dp._table.signatures["m"] = ModelSignature(  # noqa: SLF001 - what refresh() fills in from Triton
        "m", 8, {"x": TensorSpec("x", "FP32", (4,))}, {"y": TensorSpec("y", "FP32", (4,))}, frozenset({"1"})
    )

    async def call(tenant: str, value: float) -> pb.ModelInferResponse:
        ctx = CallContext(keys[tenant], idempotency_key="order-1")
        return pb.ModelInferResponse.FromString((await dp.infer(_infer_request(value), ctx=ctx)).raw)

    acme = await call("acme", 1.0)
    globex = await call("globex", 2.0)
    assert struct.unpack("<4f", acme.raw_output_contents[0]) == (1.0,) * 4
    assert struct.unpack("<4f", globex.raw_output_contents[0]) == (2.0,) * 4
    assert (acme.id, globex.id, backend.calls) == ("run-1", "run-2", 2)
    # within one tenant the key still replays: no third run
    assert (await call("acme", 1.0)).id == "run-1" and backend.calls == 2
    with pytest.raises(IdempotencyKeyReused):
        await call("globex", 3.0)


async def test_runs_and_replays_are_counted_one_each():
    store = MemoryIdempotency()
    assert (store.runs, store.replays) == (0, 0)
    fn, d = Counter(), body_digest(b"x")
    await store.run("k", d, fn)
    assert (store.runs, store.replays) == (1, 0)
    await store.run("k", d, fn)
    await store.run("k", d, fn)
    assert (store.runs, store.replays) == (1, 2)
    with pytest.raises(IdempotencyKeyReused):
        await store.run("k", body_digest(b"y"), fn)
    assert (store.runs, store.replays) == (1, 2)  # a conflict is neither
    await store.run("k2", d, fn)
    assert store.runs == 2


async def test_the_store_keeps_max_entries_answers_and_drops_the_oldest_beyond():
    assert MemoryIdempotency().max_entries == 100_000  # the documented default bound
    store = MemoryIdempotency(max_entries=2)
    fn, d = Counter(), body_digest(b"x")
    await store.run("a", d, fn)
    await store.run("b", d, fn)
    assert await store.run("b", d, fn) == b"answer-2"  # two entries: at the bound, none dropped
    assert await store.run("a", d, fn) == b"answer-1" and fn.calls == 2
    await store.run("c", d, fn)  # a third: the oldest goes at the next call
    await store.run("c", d, fn)
    assert await store.run("a", d, fn) == b"answer-4" and fn.calls == 4


async def test_redis_runs_and_replays_are_counted_one_each(redis_url):
    store = RedisIdempotency(redis_url)
    try:
        await store.client.flushdb()
        assert (store.runs, store.replays) == (0, 0)
        fn, d = Counter(), body_digest(b"x")
        await store.run(scoped("t", "count"), d, fn)
        await store.run(scoped("t", "count"), d, fn)
        await store.run(scoped("t", "count"), d, fn)
        assert (store.runs, store.replays) == (1, 2)
        await store.run(scoped("t", "other"), d, fn)
        assert store.runs == 2
    finally:
        await store.close()


async def _running_first(store, key: str, digest: bytes, name: bytes):
    """Start a first request that runs until the returned event is set; return once its claim is in Redis."""
    gate = asyncio.Event()

    async def slow():
        await gate.wait()
        return b"done"

    task = asyncio.create_task(store.run(key, digest, slow))
    while await store.client.get(name) is None:
        await asyncio.sleep(0.001)
    return task, gate


async def test_redis_keeps_a_claim_then_the_answer_under_its_key_with_their_expiries(redis_url):
    """``P`` + digest while running (expiring after claim_ttl_s, should the process die), then ``D`` + digest
    + answer (expiring after ttl_s), under ``inferplane:idem:<tenant>\\0<key>``: what every frontend reads."""
    assert RedisIdempotency(redis_url).claim_ttl_ms == 60_000  # the default claim outlives a slow answer by far
    store = RedisIdempotency(redis_url, ttl_s=10, claim_ttl_s=1000)
    try:
        await store.client.flushdb()
        key, d = scoped("t", "ttl"), body_digest(b"x")
        name = b"inferplane:idem:t\x00ttl"
        task, gate = await _running_first(store, key, d, name)
        assert await store.client.get(name) == b"P" + d
        assert 0 < await store.client.pttl(name) <= 1_000_000  # claim_ttl_s, in milliseconds
        gate.set()
        assert await task == b"done"
        assert await store.client.get(name) == b"D" + d + b"done"
        assert 0 < await store.client.pttl(name) <= 10_000
    finally:
        await store.close()


async def test_redis_a_duplicate_waits_at_most_its_deadline_or_max_wait(redis_url):
    """While the first request runs, a duplicate waits for its answer: past the caller's deadline it is
    DEADLINE_EXCEEDED; past max_wait_s (a deadline beyond it, or none) UNAVAILABLE with a retry hint."""
    first = RedisIdempotency(redis_url)
    try:
        await first.client.flushdb()
        key, d = scoped("t", "wait"), body_digest(b"x")
        task, gate = await _running_first(first, key, d, b"inferplane:idem:t\x00wait")
        with pytest.raises(DeadlineExceeded) as late:
            await first.run(key, d, Counter(), timeout=0.05)  # the default max_wait_s is 60 s: the deadline decides
        assert late.value.message == "deadline exceeded waiting for the first request with this idempotency key"
        short = RedisIdempotency(redis_url, max_wait_s=0.05)
        try:
            with pytest.raises(DeadlineExceeded):
                await short.run(key, d, Counter(), timeout=0.05)  # a deadline of exactly max_wait_s is the caller's
            for timeout in (None, 10.0):
                with pytest.raises(BackendUnavailable) as busy:
                    await short.run(key, d, Counter(), timeout=timeout)
                assert busy.value.message == "the first request with this idempotency key is still running"
                assert busy.value.retry_after_s == 1.0
        finally:
            await short.close()
        gate.set()
        assert await task == b"done"
        assert await first.run(key, d, Counter(), timeout=0.05) == b"done"
    finally:
        await first.close()


async def test_redis_a_claim_that_expires_before_it_is_read_is_taken_over_before_running(redis_url):
    """Another frontend's claim expires between this request's ``SET NX`` (refused) and its read
    (nothing there): the request claims the key itself, and only then runs, so a further duplicate
    arriving while it runs waits for its answer instead of running too."""
    store = RedisIdempotency(redis_url)
    try:
        await store.client.flushdb()
        key, d = scoped("t", "race"), body_digest(b"x")
        name = b"inferplane:idem:t\x00race"
        await store.client.set(name, b"P" + d, px=60_000)  # a claim of a frontend that then died
        read = store.client.get

        async def read_after_expiry(n):
            await store.client.delete(n)  # the claim expires just before this read
            return await read(n)

        store.client.get = read_after_expiry
        held: list[bytes | None] = []

        async def fn():
            held.append(await read(name))
            return b"mine"

        assert await store.run(key, d, fn) == b"mine"
        assert held == [b"P" + d]  # it ran under its own claim
        assert await read(name) == b"D" + d + b"mine" and store.runs == 1
    finally:
        await store.close()
