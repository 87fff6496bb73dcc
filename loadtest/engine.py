"""The load engine: closed loop and open loop over a `Driver`, in one event loop.

Timeline (all on the monotonic clock, which is shared by every process on the machine):
    t0 ........ t0+warmup ................ t0+warmup+duration ..... drained
       warm-up        measured window           (in-flight requests finish)
A request belongs to the measured window when it was *started* (closed loop) or *scheduled*
(open loop) inside it. Open-loop latency counts from the scheduled send time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loadtest.histogram import LatencyHistogram
from loadtest.protocol import CALL_STARTED, CallError, Driver
from loadtest.schedule import arrival_offsets

clock = time.monotonic


@dataclass(frozen=True)
class LoadSpec:
    """What load to offer: `concurrency` callers (closed loop) or `rate` req/s (open loop)."""

    concurrency: int | None = None
    rate: float | None = None
    poisson: bool = False
    warmup: float = 1.0
    duration: float = 10.0
    max_inflight: int = 10_000
    seed: int = 0
    phase: float = 0.0
    drain_timeout: float = 30.0
    # closed loop: a caller refused with a retry hint waits that long before its next call (as a
    # client that honours retry-after does) instead of sending again at once
    honor_retry_after: bool = False

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.duration <= 0 or self.warmup < 0:
            raise ValueError("duration must be > 0 and warmup >= 0")

    @property
    def open_loop(self) -> bool:
        return self.rate is not None


class Stats:
    """Counters of one engine run. `live_*` include warm-up and feed the progress display."""

    def __init__(self) -> None:
        self.latency = LatencyHistogram()  # closed: send->answer; open: scheduled->answer
        self.service = LatencyHistogram()  # open loop only: actual send->answer
        self.refused = LatencyHistogram()  # send->error status (the server's answer was an error, e.g. a refusal)
        self.ok = 0
        self.errors: dict[str, list] = {}  # code -> [count, first message]
        self.scheduled = 0  # open loop: arrivals scheduled inside the window
        self.unfinished = 0
        self.max_lag = 0.0  # open loop: worst (actual send - scheduled) in the window
        self.lag_sum = 0.0
        self.live_ok = 0
        self.live_err = 0
        self.backoffs = 0  # closed loop, honor_retry_after: refusals in the window the caller waited out

    def error(self, code: str, message: str) -> None:
        e = self.errors.get(code)
        if e is None:
            self.errors[code] = [1, message]
        else:
            e[0] += 1

    @property
    def error_count(self) -> int:
        return sum(v[0] for v in self.errors.values())

    def to_wire(self) -> dict:
        """Picklable form for crossing a process boundary."""
        return {
            "latency": self.latency.encode() if self.latency.count else b"",
            "service": self.service.encode() if self.service.count else b"",
            "refused": self.refused.encode() if self.refused.count else b"",
            "ok": self.ok,
            "errors": self.errors,
            "scheduled": self.scheduled,
            "unfinished": self.unfinished,
            "max_lag": self.max_lag,
            "lag_sum": self.lag_sum,
            "backoffs": self.backoffs,
        }

    @classmethod
    def merge_wire(cls, parts: list[dict]) -> "Stats":
        out = cls()
        for p in parts:
            out.latency.add(LatencyHistogram.decode(p["latency"]))
            out.service.add(LatencyHistogram.decode(p["service"]))
            out.refused.add(LatencyHistogram.decode(p["refused"]))
            out.ok += p["ok"]
            for code, (n, msg) in p["errors"].items():
                e = out.errors.setdefault(code, [0, msg])
                e[0] += n
            out.scheduled += p["scheduled"]
            out.unfinished += p["unfinished"]
            out.max_lag = max(out.max_lag, p["max_lag"])
            out.lag_sum += p["lag_sum"]
            out.backoffs += p.get("backoffs", 0)
        return out


def _client_error(exc: BaseException) -> tuple[str, str]:
    return f"CLIENT_{type(exc).__name__}", str(exc)


async def run_engine(
    driver: Driver,
    pool: list[bytes],
    spec: LoadSpec,
    t0: float,
    stats: Stats,
    *,
    pool_offset: int = 0,
) -> Stats:
    """Offer `spec`'s load starting at monotonic time `t0`; returns when drained."""
    if not pool:
        raise ValueError("empty request pool")
    if spec.open_loop:
        await _open_loop(driver, pool, spec, t0, stats, pool_offset)
    else:
        await _closed_loop(driver, pool, spec, t0, stats, pool_offset)
    return stats


async def _closed_loop(driver, pool, spec, t0, stats, pool_offset) -> None:
    t_meas = t0 + spec.warmup
    t_end = t_meas + spec.duration
    n = len(pool)
    record = stats.latency.record
    honor = spec.honor_retry_after

    async def caller(idx: int) -> None:
        session = await driver.session(idx)
        i = pool_offset + idx * 7919
        delay = t0 - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            while True:
                start = clock()
                if start >= t_end:
                    return
                payload = pool[i % n]
                i += 1
                CALL_STARTED.set(start)
                try:
                    await session.call(payload)
                except CallError as e:
                    stats.live_err += 1
                    if start >= t_meas:
                        stats.error(e.code, e.message)
                        stats.refused.record(clock() - start)
                    if honor and e.retry_after:
                        wait = min(e.retry_after, t_end - clock())
                        if wait > 0:
                            stats.backoffs += start >= t_meas
                            await asyncio.sleep(wait)
                    continue
                except Exception as e:  # noqa: BLE001 - count, never kill the run
                    stats.live_err += 1
                    if start >= t_meas:
                        stats.error(*_client_error(e))
                    continue
                end = clock()
                stats.live_ok += 1
                if start >= t_meas:
                    stats.ok += 1
                    record(end - start)
        finally:
            await session.close()

    await asyncio.gather(*(caller(i) for i in range(spec.concurrency)))


async def _open_loop(driver, pool, spec, t0, stats, pool_offset) -> None:
    t_meas = t0 + spec.warmup
    t_end = t_meas + spec.duration
    n = len(pool)
    session = await driver.session(0)
    if not session.concurrent_safe:
        await session.close()
        raise ValueError("open loop needs a unary protocol (drop --stream or use --concurrency)")
    record = stats.latency.record
    record_service = stats.service.record
    call = session.call
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()
    slot = asyncio.Event()
    state = {"inflight": 0, "waiting": False}
    max_inflight = spec.max_inflight

    async def one(sched: float, payload: bytes) -> None:
        sent = clock()
        # Timers may fire a little early; then the request is measured from its real send.
        origin = sched if sched < sent else sent
        measured = sched >= t_meas
        if measured:
            lag = sent - origin
            stats.lag_sum += lag
            if lag > stats.max_lag:
                stats.max_lag = lag
        CALL_STARTED.set(sched)
        try:
            await call(payload)
        except CallError as e:
            stats.live_err += 1
            if measured:
                stats.error(e.code, e.message)
                stats.refused.record(clock() - sent)
        except Exception as e:  # noqa: BLE001
            stats.live_err += 1
            if measured:
                stats.error(*_client_error(e))
        else:
            end = clock()
            stats.live_ok += 1
            if measured:
                stats.ok += 1
                record(end - origin)
                record_service(end - sent)
        finally:
            state["inflight"] -= 1
            if state["waiting"]:
                state["waiting"] = False
                slot.set()

    i = pool_offset
    for off in arrival_offsets(spec.rate, poisson=spec.poisson, seed=spec.seed, phase=spec.phase):
        sched = t0 + off
        if sched >= t_end:
            break
        delay = sched - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        while state["inflight"] >= max_inflight:
            # Latency still counts from `sched`, so this wait is charged to the target.
            state["waiting"] = True
            slot.clear()
            await slot.wait()
        if sched >= t_meas:
            stats.scheduled += 1
        state["inflight"] += 1
        t = loop.create_task(one(sched, pool[i % n]))
        i += 1
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    if tasks:
        done, pending = await asyncio.wait(set(tasks), timeout=spec.drain_timeout)
        if pending:
            stats.unfinished += len(pending)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    await session.close()
