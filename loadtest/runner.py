"""One load run: build the request pool, offer the load (in-process or K worker processes),
sample CPU of the processes under test, and assemble the JSON result."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
from dataclasses import dataclass, field, replace

from loadtest import procstat
from loadtest.drivers import make_driver
from loadtest.engine import LoadSpec, Stats, clock, run_engine
from loadtest.progress import LiveProgress
from loadtest.protocol import fetch_model_metadata, protocol_of
from loadtest.request_pool import build_pool, sse_pool
from loadtest.schedule import split_rate


@dataclass(frozen=True)
class RunConfig:
    target: str
    model: str
    spec: LoadSpec
    stream: bool = False
    channels: int = 1
    timeout: float | None = 30.0
    metadata: tuple[tuple[str, str], ...] = ()
    processes: int = 1
    batch: int = 1
    pids: tuple[int, ...] = field(default_factory=tuple)
    label: str = ""
    rest_json: bool = False  # http:// targets: JSON tensors instead of the binary extension
    sse: bool = False  # http:// targets: OpenAI chat completion token streams (as sse://)

    @property
    def protocol(self) -> str:
        return protocol_of(self.target, stream=self.stream, rest_json=self.rest_json, sse=self.sse)


def prepare_pool(
    target: str,
    model: str,
    *,
    data: str = "random",
    repository: str | None = None,
    batch: int = 1,
    size: int = 64,
    seed: int = 0,
    metadata: tuple[tuple[str, str], ...] = (),
    version: str = "",
    rest_json: bool = False,
    sse: bool = False,
    prompts: list[str] | tuple[str, ...] | None = None,
    max_tokens: int = 64,
    ignore_eos: bool = False,
) -> list:
    """Pre-serialize `size` requests for the target's protocol.

    gRPC and REST: fetch the model's signature (ModelMetadata RPC, or `GET /v2/models/{model}`)
    and encode the data as ModelInferRequest bytes or REST `(body, headers)` items. SSE: one
    streaming chat-completion body per prompt (`prompts`, else a small built-in set).
    """
    proto = protocol_of(target, rest_json=rest_json, sse=sse)
    if proto == "sse":
        extra = {"ignore_eos": True} if ignore_eos else {}
        return sse_pool(model, prompts, max_tokens=max_tokens, size=size, **extra)
    md = fetch_model_metadata(target, model, version=version, metadata=metadata)
    if not md.name:
        md.name = model
    encoding = {"grpc": "grpc", "rest": "rest", "rest-json": "rest-json"}[proto]
    return build_pool(
        md, data=data, repository=repository, batch=batch, size=size, seed=seed, version=version, encoding=encoding
    )


def _driver_for(cfg: RunConfig, spec: LoadSpec | None = None):
    spec = spec or cfg.spec
    # HTTP drivers: one connection per caller (closed loop), up to --max-inflight (open loop)
    connections = spec.max_inflight if spec.open_loop else spec.concurrency
    return make_driver(
        cfg.target, model=cfg.model, stream=cfg.stream, rest_json=cfg.rest_json, sse=cfg.sse,
        channels=cfg.channels, connections=connections, timeout=cfg.timeout, metadata=cfg.metadata,
    )  # fmt: skip


def _worker_spec(spec: LoadSpec, parts: int, index: int) -> LoadSpec | None:
    if spec.open_loop:
        rate, phase = split_rate(spec.rate, parts, index, spec.poisson)
        return replace(spec, rate=rate, phase=phase, seed=spec.seed * 1000 + index,
                       max_inflight=max(1, spec.max_inflight // parts))
    share = spec.concurrency // parts + (1 if index < spec.concurrency % parts else 0)
    return replace(spec, concurrency=share) if share else None


# ---------------------------------------------------------------- in-process run


async def run_async(cfg: RunConfig, pool: list[bytes], *, quiet: bool = True) -> dict:
    """Single-process run inside the running event loop (what tests and `run` use)."""
    spec = cfg.spec
    driver = _driver_for(cfg)
    await driver.open()
    stats = Stats()
    cpu: dict = {}
    try:
        t0 = clock() + 0.05
        t_meas, t_end = t0 + spec.warmup, t0 + spec.warmup + spec.duration
        driver.measure_window(t_meas, t_end)
        keeper = asyncio.ensure_future(_timekeeper(t0, t_meas, t_end, cfg.pids, cpu, stats, cfg, quiet))
        try:
            await run_engine(driver, pool, spec, t0, stats)
        finally:
            cpu["done"] = True
            await keeper
    finally:
        await driver.close()
    wire = driver.extra_wire()
    return assemble(cfg, stats, cpu, extras=[wire] if wire is not None else None, driver_cls=type(driver))


async def _timekeeper(t0, t_meas, t_end, pids, cpu, stats, cfg, quiet) -> None:
    """Takes the CPU snapshots at the window edges and drives the progress bar."""
    me = os.getpid()
    with LiveProgress(cfg.label or cfg.target, cfg.spec.warmup, cfg.spec.duration, quiet=quiet) as bar:
        for edge, key in ((t_meas, "before"), (t_end, "after")):
            while True:
                now = clock()
                if now >= edge or cpu.get("done"):
                    break
                bar.update(now - t0, stats.live_ok, stats.live_err)
                await asyncio.sleep(min(0.25, max(0.0, edge - now)))
            if cpu.get("done") and key == "before":
                break
            cpu[key] = procstat.snapshot(list(pids))
            cpu[f"client_{key}"] = procstat.process_tree_cpu(me)
            cpu[f"t_{key}"] = clock()
        while not cpu.get("done"):
            bar.update(clock() - t0, stats.live_ok, stats.live_err)
            await asyncio.sleep(0.25)
        bar.update(clock() - t0, stats.live_ok, stats.live_err)


# ---------------------------------------------------------------- multi-process run


def _worker_main(index, parts, cfg: RunConfig, pool, barrier, counters, results) -> None:
    spec = _worker_spec(cfg.spec, parts, index)

    async def main() -> None:
        stats = Stats()
        driver = _driver_for(cfg, spec)
        try:
            await driver.open()
        except BaseException:
            barrier.abort()
            raise
        barrier.wait(timeout=120)
        t0 = clock() + 0.05
        driver.measure_window(t0 + spec.warmup, t0 + spec.warmup + spec.duration)

        async def tick() -> None:
            while True:
                counters[2 * index] = stats.live_ok
                counters[2 * index + 1] = stats.live_err
                await asyncio.sleep(0.25)

        ticker = asyncio.ensure_future(tick())
        try:
            await run_engine(driver, pool, spec, t0, stats, pool_offset=index * 131)
        finally:
            ticker.cancel()
            counters[2 * index] = stats.live_ok
            counters[2 * index + 1] = stats.live_err
            await driver.close()
        results.put((index, {**stats.to_wire(), "extra": driver.extra_wire()}))

    try:
        _run_loop(main())
    except BaseException as e:  # noqa: BLE001 - report to the parent instead of hanging it
        results.put((index, {"error": f"{type(e).__name__}: {e}"}))


def _run_loop(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def _run_processes(cfg: RunConfig, pool: list[bytes], quiet: bool) -> dict:
    spec = cfg.spec
    parts = cfg.processes
    specs = [_worker_spec(spec, parts, i) for i in range(parts)]
    active = [i for i, s in enumerate(specs) if s is not None]
    ctx = mp.get_context("spawn")  # never fork a process that may hold gRPC state
    barrier = ctx.Barrier(len(active) + 1)
    counters = ctx.Array("q", 2 * parts, lock=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker_main, args=(i, parts, cfg, pool, barrier, counters, results), daemon=True)
        for i in active
    ]
    for p in procs:
        p.start()
    cpu: dict = {}
    me = os.getpid()
    try:
        barrier.wait(timeout=120)
    except Exception as e:
        for p in procs:
            p.kill()
        raise RuntimeError(f"load workers failed to start: {_drain_errors(results)}") from e
    t0 = clock() + 0.05
    t_meas, t_end = t0 + spec.warmup, t0 + spec.warmup + spec.duration
    got: dict[int, dict] = {}
    deadline = t_end + spec.drain_timeout + 30
    with LiveProgress(cfg.label or cfg.target, spec.warmup, spec.duration, quiet=quiet) as bar:
        while len(got) < len(active) and clock() < deadline:
            now = clock()
            for edge, key in ((t_meas, "before"), (t_end, "after")):
                if now >= edge and key not in cpu:
                    cpu[key] = procstat.snapshot(list(cfg.pids))
                    cpu[f"client_{key}"] = procstat.process_tree_cpu(me)
                    cpu[f"t_{key}"] = now
            ok = sum(counters[0::2])
            err = sum(counters[1::2])
            bar.update(now - t0, ok, err)
            wait = 0.25
            for edge in (t_meas, t_end):
                if now < edge:
                    wait = min(wait, edge - now)
            try:
                idx, wire = results.get(timeout=max(0.001, wait))
                got[idx] = wire
            except queue.Empty:
                pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    failed = {i: w["error"] for i, w in got.items() if "error" in w}
    if failed or len(got) < len(active):
        raise RuntimeError(f"load workers failed: {failed or 'timed out'}")
    stats = Stats.merge_wire([got[i] for i in sorted(got)])
    extras = [got[i]["extra"] for i in sorted(got) if got[i].get("extra") is not None]
    return assemble(cfg, stats, cpu, extras=extras or None, driver_cls=type(_driver_for(cfg)))


def _drain_errors(results) -> list:
    out = []
    try:
        while True:
            out.append(results.get_nowait())
    except queue.Empty:
        pass
    return out


# ---------------------------------------------------------------- entry points


def run(cfg: RunConfig, pool: list[bytes], *, quiet: bool = True) -> dict:
    """Blocking run: in this process (uvloop) or across `cfg.processes` worker processes."""
    if cfg.processes > 1:
        return _run_processes(cfg, pool, quiet)
    return _run_loop(run_async(cfg, pool, quiet=quiet))


def assemble(cfg: RunConfig, stats: Stats, cpu: dict, *, extras: list[dict] | None = None, driver_cls=None) -> dict:
    spec = cfg.spec
    ok = stats.ok
    errors = dict(stats.errors)
    if stats.unfinished:
        errors.setdefault("UNFINISHED", [0, f"still in flight {spec.drain_timeout}s after the window"])
        errors["UNFINISHED"][0] += stats.unfinished
    n_err = sum(v[0] for v in errors.values())
    out = {
        "target": cfg.target,
        "model": cfg.model,
        "protocol": cfg.protocol,
        "mode": "open" if spec.open_loop else "closed",
        "concurrency": spec.concurrency,
        "rate": spec.rate,
        "poisson": spec.poisson if spec.open_loop else None,
        "batch": cfg.batch,
        "processes": cfg.processes,
        "warmup_s": spec.warmup,
        "duration_s": spec.duration,
        "requests": ok,
        "errors_total": n_err,
        "errors": {code: {"count": n, "first_message": msg} for code, (n, msg) in sorted(errors.items())},
        "throughput_rps": ok / spec.duration,
        "inferences_per_s": ok * cfg.batch / spec.duration,
        "latency_ms": stats.latency.summary_ms(),
    }
    if stats.refused.count:
        out["error_latency_ms"] = stats.refused.summary_ms()  # send -> error status (refusals, mostly)
    if spec.honor_retry_after:
        out["backoffs"] = stats.backoffs  # refusals whose retry hint the caller waited out
    if extras and driver_cls is not None:
        out.update(driver_cls.extra_report(extras, spec.duration))
    if spec.open_loop:
        out["scheduled"] = stats.scheduled
        out["offered_rps"] = stats.scheduled / spec.duration
        out["service_time_ms"] = stats.service.summary_ms()
        sent = ok + n_err
        out["send_lag_ms"] = {
            "mean": stats.lag_sum * 1000 / sent if sent else 0.0,
            "max": stats.max_lag * 1000,
        }
    if cfg.pids and "before" in cpu and "after" in cpu:
        out["cpu"] = procstat.cpu_report(cpu["before"], cpu["after"], ok + n_err)
    if "before" in cpu and "after" in cpu:
        cb, ca = cpu.get("client_before"), cpu.get("client_after")
        if cb is not None and ca is not None:
            out["client_cpu_ms_per_request"] = round((ca - cb) * 1000 / (ok + n_err), 5) if ok + n_err else None
    return out

