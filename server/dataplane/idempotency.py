"""Idempotency keys: the same key and body answer once; a different body under the key is refused.

A caller sends ``idempotency-key: <key>`` (gRPC metadata or HTTP header). Keys are scoped by
tenant. The first request with a key runs; its answer (the serialized ModelInferResponse) is kept
for ``ttl_s``. A repeat with the same body gets the stored answer without running the model;
one that arrives while the first is still running waits for its answer (concurrent duplicates
run the model once). A repeat with a different body is ``IdempotencyKeyReused``. Failures are
not stored: when the first run fails or is cancelled, a waiting duplicate runs in its place.

Two stores: :class:`MemoryIdempotency` (one process; the default) and
:class:`RedisIdempotency` (shared by every frontend process, when ``redis_url`` is configured).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.errors import BackendUnavailable, DeadlineExceeded, IdempotencyKeyReused

Run = Callable[[], Awaitable[bytes]]
DEFAULT_TTL_S = 24 * 3600.0


def body_digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


def scoped(tenant: str, key: str) -> str:
    return f"{tenant}\x00{key}"


def _reused(key: str) -> IdempotencyKeyReused:
    return IdempotencyKeyReused(f"idempotency key {key!r} was already used with a different request body")


@dataclass
class _Entry:
    digest: bytes
    future: asyncio.Future  # result: bytes (done), or None (the run failed: run again)
    expires: float


class MemoryIdempotency:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # insertion order = expiry order
        self.runs = 0
        self.replays = 0

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            first = next(iter(entries.values()))
            expired = first.expires <= now
            if not expired and (len(entries) <= self.max_entries or not first.future.done()):
                break  # never drop a running entry for size
            entries.popitem(last=False)

    async def run(self, key: str, digest: bytes, fn: Run, timeout: float | None = None) -> bytes:
        while True:
            now = self._clock()
            self._expire(now)
            entry = self._entries.get(key)
            if entry is None:
                break
            if entry.digest != digest:
                raise _reused(key.rpartition("\x00")[2])
            result = await asyncio.shield(entry.future)
            if result is not None:
                self.replays += 1
                return result
            # the first run failed; loop: it was removed, this caller runs (or waits for another)
        future = asyncio.get_running_loop().create_future()
        entry = self._entries[key] = _Entry(digest, future, self._clock() + self.ttl_s)
        self.runs += 1
        try:
            result = await fn()
        except BaseException:
            if self._entries.get(key) is entry:
                del self._entries[key]
            future.set_result(None)
            raise
        future.set_result(result)
        return result


class RedisIdempotency:
    """The same contract over Redis: ``SET NX`` claims a key, the answer replaces the claim.

    Values: ``b"P" + digest`` while running (expires after ``claim_ttl_s`` should the process die),
    ``b"D" + digest + answer`` once answered (expires after ``ttl_s``).
    """

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, claim_ttl_s: float = 60.0, poll_s: float = 0.005, max_wait_s: float = 60.0):
        from redis import asyncio as aioredis

        self.client = aioredis.from_url(url)
        self.ttl_ms = int(ttl_s * 1000)
        self.claim_ttl_ms = int(claim_ttl_s * 1000)
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s
        self.runs = 0
        self.replays = 0

    async def close(self) -> None:
        await self.client.aclose()

    async def run(self, key: str, digest: bytes, fn: Run, timeout: float | None = None) -> bytes:
        name = b"inferplane:idem:" + key.encode()
        give_up = time.monotonic() + (self.max_wait_s if timeout is None else min(timeout, self.max_wait_s))
        poll = self.poll_s
        while True:
            if await self.client.set(name, b"P" + digest, nx=True, px=self.claim_ttl_ms):
                break
            value = await self.client.get(name)
            if value is None:
                continue  # expired or released between the two calls
            if value[1:33] != digest:
                raise _reused(key.rpartition("\x00")[2])
            if value[:1] == b"D":
                self.replays += 1
                return value[33:]
            if time.monotonic() >= give_up:
                if timeout is not None and timeout <= self.max_wait_s:
                    raise DeadlineExceeded("deadline exceeded waiting for the first request with this idempotency key")
                raise BackendUnavailable("the first request with this idempotency key is still running", retry_after_s=1.0)
            await asyncio.sleep(poll)
            poll = min(poll * 2, 0.1)
        self.runs += 1
        try:
            result = await fn()
        except BaseException:
            await asyncio.shield(self.client.delete(name))
            raise
        await self.client.set(name, b"D" + digest + result, px=self.ttl_ms)
        return result
