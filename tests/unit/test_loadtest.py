"""Unit tests for the loadtest package: histograms, schedules, open/closed loop engines,
error counting, compare mode against local dummy gRPC servers, perf_analyzer fetch.

Short runs only; no assertions on absolute speed."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import time

import numpy as np
import pytest

from loadtest.autoscale import main as autoscale_main
from loadtest.autoscale import replica_seconds, scale_up_seconds, trace_ratios
from loadtest.compare import compare, summarize
from loadtest.dummy_server import DummyProcess
from loadtest.engine import LoadSpec, Stats, clock, run_engine
from loadtest.histogram import LatencyHistogram
from loadtest.perf_analyzer import parse_csv
from loadtest.procstat import cpu_report, process_tree_cpu, snapshot
from loadtest.protocol import CallError, Driver, Session, parse_grpc_target
from loadtest.request_pool import build_pool, concrete_shape, random_pool, validation_pool
from loadtest.runner import RunConfig, prepare_pool, run
from loadtest.schedule import arrival_offsets, split_rate
from server.protogen.inference import grpc_service_pb2 as pb


# ---------------------------------------------------------------- helpers


@pytest.fixture
def dummy_factory():
    """Real dummy gRPC servers (loadtest.dummy_server subprocesses), closed at the end of the test."""
    servers: list[DummyProcess] = []

    def make(*args: str) -> DummyProcess:
        s = DummyProcess(*args)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def dummy():
    """One real dummy gRPC server without knobs for the module's tests that only send to it (it keeps no
    state a test could see: each test's figures are its own window's); a process start each saved."""
    with DummyProcess() as s:
        yield s


class FakeSession(Session):
    def __init__(self, driver: "FakeDriver") -> None:
        self.d = driver

    async def call(self, payload: bytes) -> None:
        await self.d.behave()


class FakeDriver(Driver):
    """No network: each call waits `delay` s; one call after `stall_at` (s from open) waits `stall` s."""

    def __init__(self, delay: float = 0.0, stall_at: float | None = None, stall: float = 0.0) -> None:
        self.delay, self.stall_at, self.stall = delay, stall_at, stall
        self.calls = 0
        self.t_open = 0.0
        self.stalled = False

    async def open(self) -> None:
        self.t_open = clock()

    async def close(self) -> None:
        pass

    async def session(self, index: int) -> Session:
        return FakeSession(self)

    async def behave(self) -> None:
        self.calls += 1
        if self.stall_at is not None and not self.stalled and clock() - self.t_open >= self.stall_at:
            self.stalled = True
            await asyncio.sleep(self.stall)
        elif self.delay:
            await asyncio.sleep(self.delay)
        else:
            await asyncio.sleep(0)


def _metadata(shape=(-1, 4), datatype="FP32", name="m"):
    md = pb.ModelMetadataResponse(name=name)
    t = md.inputs.add()
    t.name, t.datatype = "input__0", datatype
    t.shape.extend(shape)
    return md


# ---------------------------------------------------------------- histogram


def test_histogram_uniform_percentiles():
    h = LatencyHistogram()
    for us in range(1, 10_001):
        h.record_us(us)
    s = h.summary_ms()
    assert h.count == 10_000
    assert s["p50"] == pytest.approx(5.0, rel=0.01)
    assert s["p90"] == pytest.approx(9.0, rel=0.01)
    assert s["p99"] == pytest.approx(9.9, rel=0.01)
    assert s["max"] == pytest.approx(10.0, rel=0.01)
    assert s["mean"] == pytest.approx(5.0, rel=0.01)


def test_histogram_exponential_matches_numpy():
    rng = np.random.default_rng(1)
    samples = rng.exponential(scale=0.001, size=200_000)  # seconds, mean 1 ms
    h = LatencyHistogram()
    for s in samples:
        h.record(float(s))
    summary = h.summary_ms()
    for p in (50, 90, 99, 99.9):
        expected = float(np.percentile(samples, p)) * 1000
        assert summary[f"p{p:g}"] == pytest.approx(expected, rel=0.01), p
    # and against the analytic quantile -ln(1-q) * mean
    assert summary["p50"] == pytest.approx(math.log(2), rel=0.02)
    assert summary["p99"] == pytest.approx(-math.log(0.01), rel=0.03)


def test_histogram_encode_decode_merge():
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for us in range(1, 5001):
        a.record_us(us)
        both.record_us(us)
    for us in range(5001, 10_001):
        b.record_us(us)
        both.record_us(us)
    merged = LatencyHistogram.decode(a.encode())
    merged.add(LatencyHistogram.decode(b.encode()))
    assert merged.count == both.count == 10_000
    assert merged.summary_ms() == both.summary_ms()
    assert LatencyHistogram.decode(b"").count == 0
    assert LatencyHistogram().summary_ms()["p99"] == 0.0


def test_stats_merge_wire():
    s1, s2 = Stats(), Stats()
    s1.latency.record(0.001)
    s1.ok = 1
    s1.error("INVALID_ARGUMENT", "first")
    s2.latency.record(0.002)
    s2.ok = 1
    s2.error("INVALID_ARGUMENT", "second")
    s2.error("UNAVAILABLE", "down")
    m = Stats.merge_wire([s1.to_wire(), s2.to_wire()])
    assert m.ok == 2 and m.latency.count == 2
    assert m.errors == {"INVALID_ARGUMENT": [2, "first"], "UNAVAILABLE": [1, "down"]}


# ---------------------------------------------------------------- schedule


def test_fixed_schedule_is_exact():
    gen = arrival_offsets(200.0)
    offs = [next(gen) for _ in range(1001)]
    assert offs[0] == 0.0
    assert offs[1000] == pytest.approx(5.0, abs=1e-12)
    assert sum(1 for o in offs if 1.0 <= o < 2.0) == 200


def test_poisson_schedule_rate_and_gaps():
    gen = arrival_offsets(1000.0, poisson=True, seed=7)
    offs = []
    for o in gen:
        if o >= 20.0:
            break
        offs.append(o)
    assert len(offs) == pytest.approx(20_000, rel=0.03)
    gaps = np.diff(offs)
    assert gaps.mean() == pytest.approx(0.001, rel=0.03)
    assert gaps.std() == pytest.approx(0.001, rel=0.05)  # exponential: std == mean
    assert all(g > 0 for g in gaps)


def test_split_rate_interleaves_fixed_workers():
    merged = []
    for i in range(3):
        rate, phase = split_rate(300.0, 3, i, poisson=False)
        gen = arrival_offsets(rate, phase=phase)
        merged += [next(gen) for _ in range(100)]
    merged.sort()
    assert np.allclose(np.diff(merged), 1 / 300.0)


# ---------------------------------------------------------------- engine (no network)


async def test_open_loop_keeps_its_rate():
    spec = LoadSpec(rate=400.0, warmup=0.2, duration=1.0)
    driver = FakeDriver(delay=0.001)
    await driver.open()
    stats = Stats()
    await run_engine(driver, [b"x"], spec, clock(), stats)
    # the rate is in the counts (every arrival of the schedule is sent, late or not): how long the run took
    # is the machine's, not asserted
    assert stats.scheduled == 400
    assert stats.ok == 400
    assert driver.calls == pytest.approx(480, abs=1)


async def test_open_loop_measures_from_scheduled_time():
    """One caller slot (max_inflight=1) and a 300 ms stall: the requests that were due during the
    stall leave late. Measured from their scheduled time they show the stall (coordinated
    omission avoided); their service time alone would hide it."""
    spec = LoadSpec(rate=100.0, warmup=0.1, duration=1.5, max_inflight=1)
    driver = FakeDriver(delay=0.0005, stall_at=0.6, stall=0.3)
    await driver.open()
    stats = Stats()
    await run_engine(driver, [b"x"], spec, clock(), stats)
    assert stats.scheduled == 150 and stats.ok == 150
    lat, svc = stats.latency.summary_ms(), stats.service.summary_ms()
    # lower bounds the stall sets by construction (a slower machine only adds to them)
    assert lat["max"] >= 280
    assert lat["p90"] >= 50  # ~30 requests were due while the stall lasted, 25 of them 50 ms or more
    assert stats.max_lag * 1000 >= 250  # they left late: the wait is in the send lag, which service time leaves out
    assert svc["p90"] <= lat["p90"]  # each latency is its service time plus its lag


async def test_closed_loop_counts_and_excludes_warmup():
    spec = LoadSpec(concurrency=4, warmup=0.3, duration=0.5)
    driver = FakeDriver(delay=0.01)
    await driver.open()
    stats = Stats()
    await run_engine(driver, [b"a", b"b"], spec, clock(), stats)
    # 4 callers, each call at least 10 ms: at most 4 x 51 starts in the 0.5 s window (how many fewer is the
    # machine's); each caller's first call began in the warm-up and is not counted
    assert 0 < stats.ok <= 4 * 51
    assert driver.calls >= stats.ok + 4
    assert stats.latency.summary_ms()["p50"] >= 9.5


# ---------------------------------------------------------------- request pool, procstat


def test_random_pool_matches_signature():
    md = _metadata(shape=(-1, 4))
    pool = random_pool(md, batch=3, size=5)
    assert len(pool) == 5 and len(set(pool)) == 5
    req = pb.ModelInferRequest.FromString(pool[0])
    assert req.model_name == "m"
    assert list(req.inputs[0].shape) == [3, 4] and req.inputs[0].datatype == "FP32"
    assert len(req.raw_input_contents[0]) == 3 * 4 * 4
    assert concrete_shape([-1, -1, 2], 5) == [5, 5, 2]
    md_bytes = _metadata(shape=(-1, 1), datatype="BYTES")
    raw = pb.ModelInferRequest.FromString(random_pool(md_bytes, batch=2, size=1)[0]).raw_input_contents[0]
    n0 = int.from_bytes(raw[:4], "little")
    assert int.from_bytes(raw[4 + n0 : 8 + n0], "little") == len(raw) - 8 - n0


def test_validation_pool_from_npz(tmp_path):
    feats = np.arange(10 * 4, dtype=np.float64).reshape(10, 4)
    (tmp_path / "m").mkdir()
    np.savez(tmp_path / "m" / "validation.npz", features=feats)
    pool = build_pool(_metadata(), data="validation", repository=tmp_path, batch=4, size=100)
    assert len(pool) == 3  # ceil(10 / 4) distinct batches
    req = pb.ModelInferRequest.FromString(pool[2])
    arr = np.frombuffer(req.raw_input_contents[0], dtype=np.float32).reshape(4, 4)
    assert arr[0, 0] == 32.0 and arr[2, 0] == 0.0  # rows 8, 9 then wrap to 0, 1
    with pytest.raises(ValueError):
        validation_pool(_metadata(shape=(-1, 3)), feats, batch=1)
    obj = tmp_path / "o"
    obj.mkdir()
    np.savez(obj / "validation.npz", features=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError):  # pickled arrays are refused
        build_pool(_metadata(name="o"), data="validation", repository=tmp_path)


def test_procstat_counts_own_cpu():
    me = os.getpid()
    before = snapshot([me, 999_999_999])
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    after = snapshot([me, 999_999_999])
    rep = cpu_report(before, after, requests=100)
    assert rep["pids"][str(me)]["cpu_s"] >= 0.2
    assert rep["pids"][str(me)]["cpu_ms_per_request"] >= 2.0
    assert rep["pids"]["999999999"]["cpu_s"] is None
    assert process_tree_cpu(999_999_999) is None


def test_parse_grpc_target():
    assert parse_grpc_target("grpc://127.0.0.1:8001") == "127.0.0.1:8001"
    assert parse_grpc_target("localhost:9") == "localhost:9"
    with pytest.raises(ValueError):
        parse_grpc_target("http://127.0.0.1:8000")


# ---------------------------------------------------------------- against dummy gRPC servers


def _cfg(target: str, **kw) -> RunConfig:
    spec = kw.pop("spec", None) or LoadSpec(concurrency=kw.pop("concurrency", 1), warmup=kw.pop("warmup", 0.3),
                                            duration=kw.pop("duration", 1.0))
    return RunConfig(target=target, model="dummy", spec=spec, **kw)


def test_closed_loop_against_dummy_server(dummy):
    srv = dummy
    pool = prepare_pool(srv.target, "dummy", batch=2, size=8)
    assert list(pb.ModelInferRequest.FromString(pool[0]).inputs[0].shape) == [2, 4]
    r = run(_cfg(srv.target, concurrency=4, pids=(srv.proc.pid,)), pool)
    assert r["requests"] > 0 and r["errors_total"] == 0  # how many in the second is the machine's speed
    assert r["throughput_rps"] == pytest.approx(r["requests"] / 1.0)
    assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"] <= r["latency_ms"]["max"]
    assert r["cpu"]["pids"][str(srv.proc.pid)]["cpu_ms_per_request"] > 0
    assert r["client_cpu_ms_per_request"] > 0


def test_error_counting_by_code(dummy_factory):
    srv = dummy_factory("--fail-every", "3")
    pool = prepare_pool(srv.target, "dummy")
    # warmup 0 and one caller: the window sees exactly the server's request sequence
    r = run(_cfg(srv.target, concurrency=1, warmup=0.0, duration=0.8), pool)
    total = r["requests"] + r["errors_total"]
    assert total >= 6  # two of the server's fail-every-3 cycles at least, for the share below to mean something
    assert set(r["errors"]) == {"INVALID_ARGUMENT"}
    assert abs(r["errors"]["INVALID_ARGUMENT"]["count"] - total / 3) <= 1  # a call in flight at the window's end may or may not count
    assert "rejected by dummy server" in r["errors"]["INVALID_ARGUMENT"]["first_message"]
    assert r["latency_ms"]["p50"] > 0  # failed requests stay out of the histogram but ok ones count
    # the same over a bidi stream: errors travel inside the stream
    rs = run(_cfg(srv.target, concurrency=1, warmup=0.0, duration=0.5, stream=True), pool)
    total = rs["requests"] + rs["errors_total"]
    assert total >= 6
    assert set(rs["errors"]) == {"STREAM_ERROR"}
    assert abs(rs["errors"]["STREAM_ERROR"]["count"] - total / 3) <= 1


def test_open_loop_against_stalling_server(dummy_factory):
    srv = dummy_factory("--stall-after-s", "1.2", "--stall-ms", "300")
    pool = prepare_pool(srv.target, "dummy")
    spec = LoadSpec(rate=200.0, warmup=0.3, duration=1.5)
    r = run(_cfg(srv.target, spec=spec), pool)
    assert r["scheduled"] == 300
    assert r["requests"] == 300 and r["errors_total"] == 0
    assert r["latency_ms"]["max"] >= 250
    assert r["latency_ms"]["p90"] >= 30  # ~60 requests arrived during the stall


def test_multiprocess_run_merges_histograms(dummy):
    srv = dummy
    pool = prepare_pool(srv.target, "dummy")
    r = run(_cfg(srv.target, concurrency=4, processes=2, warmup=0.3, duration=1.0), pool)
    assert r["processes"] == 2
    assert r["requests"] > 0 and r["errors_total"] == 0
    assert r["latency_ms"]["p50"] > 0


def _recorded(p50: float, rps: float) -> dict:
    """A run result as loadtest.runner.run returns it, with the figures compare() reads."""
    latency = {"p50": p50, "p90": 2 * p50, "p99": 3 * p50, "p99.9": 4 * p50, "max": 5 * p50, "mean": 1.1 * p50}
    return {"throughput_rps": rps, "latency_ms": latency, "errors_total": 0, "requests": int(rps)}


def test_compare_interleaves_the_rounds_and_summarizes_what_each_measured(monkeypatch):
    # recorded rounds: B answers 2 ms later than A in each (A drifts from round to round, B with it)
    recorded = {"a": [_recorded(p, 4000.0) for p in (0.5, 0.7, 0.6)], "b": [_recorded(p, 400.0) for p in (2.5, 2.8, 2.6)]}
    calls: list[str] = []

    def fake_run(cfg: RunConfig, pool: list[bytes], *, quiet: bool = True) -> dict:
        calls.append(cfg.label)
        return recorded[cfg.label].pop(0)

    monkeypatch.setattr("loadtest.compare.run", fake_run)
    cfg_a, cfg_b = _cfg("grpc://127.0.0.1:1", label="a"), _cfg("grpc://127.0.0.1:2", label="b")
    rounds_seen: list[int] = []
    res = compare(cfg_a, cfg_b, [b"x"], [b"y"], rounds=3, on_round=lambda i, ra, rb: rounds_seen.append(i))
    assert calls == ["a", "b"] * 3 and rounds_seen == [0, 1, 2]  # A, B, A, B, ...: a drift falls on both
    s = res["summary"]
    assert [r["latency_ms"]["p50"] for r in res["runs_b"]] == [2.5, 2.8, 2.6]
    assert s["diff_b_minus_a"]["p50_ms"]["rounds"] == pytest.approx([2.0, 2.1, 2.0])
    assert s["diff_b_minus_a"]["p50_ms"]["median"] == pytest.approx(2.0)
    assert s["ratio_b_over_a"]["p50_ms"]["rounds"] == pytest.approx([5.0, 4.0, 2.6 / 0.6])
    assert s["ratio_b_over_a"]["p50_ms"]["min"] == pytest.approx(4.0)
    assert s["ratio_b_over_a"]["throughput_rps"]["median"] == pytest.approx(0.1)
    assert (res["a"]["label"], res["b"]["label"], res["rounds"], res["load"]["concurrency"]) == ("a", "b", 3, 1)
    json.loads(json.dumps(res))  # JSON-serializable
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        compare(cfg_a, cfg_b, [b"x"], [b"y"], rounds=0)


def test_compare_runs_both_real_servers_in_each_round(dummy, dummy_factory):
    """compare() against two real dummy servers, B adding 2 ms to each answer. Only what holds by
    construction is asserted (every B answer waited its 2 ms); how well compare() measures the
    difference is a benchmark: `python -m loadtest delay-check` (BENCHMARKS.md §24)."""
    a = dummy
    b = dummy_factory("--delay-ms", "2")
    pool = prepare_pool(a.target, "dummy")
    cfg_a = _cfg(a.target, concurrency=2, warmup=0.1, duration=0.4, label="direct")
    cfg_b = _cfg(b.target, concurrency=2, warmup=0.1, duration=0.4, label="delayed")
    res = compare(cfg_a, cfg_b, pool, pool, rounds=2)
    assert len(res["runs_a"]) == len(res["runs_b"]) == 2
    assert all(r["requests"] > 0 and r["errors_total"] == 0 for r in res["runs_a"] + res["runs_b"])
    assert [r["target"] for r in res["runs_b"]] == [b.target] * 2
    assert res["summary"]["b"]["p50_ms"]["min"] >= 2.0  # B's server slept 2 ms before each answer
    json.dumps(res)


def test_delay_check_reports_the_difference_and_exits_1_outside_its_tolerance(tmp_path):
    from typer.testing import CliRunner

    from loadtest.cli import app

    out = tmp_path / "delay.json"
    args = ["delay-check", "--rounds", "1", "-d", "0.2", "-w", "0.05", "--json", str(out), "-q"]
    assert CliRunner().invoke(app, [*args, "--tolerance-ms", "1000"]).exit_code == 0  # any measured difference is within
    check = json.loads(out.read_text())["delay_check"]
    assert check["delay_ms"] == 2.0 and check["within"] is True and len(check["diff_p50_ms"]["rounds"]) == 1
    assert len(check["load_average_before"]) == 3 and check["cpus"] == os.cpu_count()
    refused = CliRunner().invoke(app, [*args, "--tolerance-ms", "-1"])  # none is within a negative tolerance
    assert refused.exit_code == 1 and json.loads(out.read_text())["delay_check"]["within"] is False


def test_summarize_spread():
    ra = [{"throughput_rps": 100.0, "latency_ms": {k: 1.0 for k in ("p50", "p90", "p99", "p99.9", "max", "mean")},
           "errors_total": 0, "requests": 100}] * 2
    rb = [{"throughput_rps": t, "latency_ms": {k: 2.0 for k in ("p50", "p90", "p99", "p99.9", "max", "mean")},
           "errors_total": 0, "requests": 100} for t in (50.0, 100.0)]
    s = summarize(ra, rb)
    assert s["ratio_b_over_a"]["p50_ms"]["median"] == 2.0
    assert s["ratio_b_over_a"]["throughput_rps"] == {
        "median": 0.75, "min": 0.5, "max": 1.0, "mean": 0.75, "stdev": pytest.approx(0.35355, rel=1e-4),
        "rounds": [0.5, 1.0],
    }
    assert "cpu_ms_per_request" not in s["a"]


def test_cli_run_and_sweep(dummy, tmp_path):
    from typer.testing import CliRunner

    from loadtest.cli import app

    srv = dummy
    runner = CliRunner()
    out = tmp_path / "run.json"
    res = runner.invoke(app, ["run", "-t", srv.target, "-m", "dummy", "-r", "100", "--poisson", "-d", "0.5",
                              "-w", "0.2", "--json", str(out), "-q"])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["mode"] == "open" and r["poisson"] is True and r["requests"] > 0
    png = tmp_path / "sweep.png"
    res = runner.invoke(app, ["sweep", "-t", f"dummy={srv.target}", "-m", "dummy", "-c", "1,4", "-d", "0.4", "-w", "0.1",
                              "--png", str(png), "--json", str(tmp_path / "sweep.json"), "-q"])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sw = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["concurrency"] for p in sw["series"]["dummy"]] == [1, 4]


# ---------------------------------------------------------------- perf_analyzer


def test_parse_perf_analyzer_csv():
    text = (
        "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,"
        "Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,"
        "p50 latency,p90 latency,p95 latency,p99 latency,Avg latency,request/response,response wait\n"
        "1,1000.5,10,100,5,1,50,1,2,950,1200,1300,2000,990,0,0\n"
        "4,3000,10,100,5,1,50,1,2,1250,1500,1600,2500,1300,0,0\n"
    )
    pts = parse_csv(text, batch=2)
    assert [p["concurrency"] for p in pts] == [1, 4]
    assert pts[0]["inferences_per_s"] == 1000.5 and pts[0]["throughput_rps"] == pytest.approx(500.25)
    assert pts[1]["latency_ms"] == {"p50": 1.25, "p90": 1.5, "p95": 1.6, "p99": 2.5, "mean": 1.3}


@pytest.mark.slow
def test_perf_analyzer_binary_runs():
    from loadtest.perf_analyzer import ensure_binary, lib_env

    binary = ensure_binary()
    assert binary.is_file() and os.access(binary, os.X_OK)
    assert ensure_binary() == binary  # idempotent
    p = subprocess.run([str(binary), "--version"], env=lib_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "2.51.0" in p.stdout + p.stderr


@pytest.mark.slow
def test_the_printed_perf_analyzer_runs_alone_without_ld_library_path():
    from typer.testing import CliRunner

    from loadtest.cli import app

    result = CliRunner().invoke(app, ["perf-analyzer", "--target", "grpc://127.0.0.1:1", "--model", "m", "--ensure-only"])
    assert result.exit_code == 0, result.output
    script = result.output.strip().splitlines()[-1]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    p = subprocess.run([script, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "2.51.0" in p.stdout + p.stderr


def test_help_texts_keep_colon_syntax_literal():
    """rich renders :name: codes as emoji; perf_analyzer's START:END:STEP must read as written."""
    from typer.testing import CliRunner

    from loadtest.cli import app as loadtest_app
    from server.cli.main import app

    for cli, args in ((loadtest_app, ["perf-analyzer", "--help"]), (app, ["loadtest", "perf-analyzer", "--help"])):
        text = CliRunner().invoke(cli, args, env={"COLUMNS": "200"}).output
        assert "START:END:STEP" in text, text
        assert not [c for c in text if ord(c) > 0x2000], text  # no emoji (nor rich's box drawing)


@pytest.mark.slow
def test_run_perf_analyzer_against_dummy_server(dummy):
    from loadtest.perf_analyzer import run_perf_analyzer

    srv = dummy
    r = run_perf_analyzer(
        srv.target, "dummy", concurrency_range="2", measurement_interval_ms=500,
        extra_args=["--stability-percentage", "1000", "--max-trials", "6"], timeout=120,
    )
    assert r["concurrency"] == 2 and r["throughput_rps"] > 0
    assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert r["latency_ms"]["mean"] is not None


# ---------------------------------------------------------------- REST and SSE drivers


def _two_input_metadata():
    md = pb.ModelMetadataResponse(name="multi")
    a = md.inputs.add()
    a.name, a.datatype = "dense", "FP32"
    a.shape.extend([-1, 3])
    b = md.inputs.add()
    b.name, b.datatype = "ids", "INT64"
    b.shape.extend([-1, 2])
    c = md.inputs.add()
    c.name, c.datatype = "text", "BYTES"
    c.shape.extend([-1, 1])
    return md


def test_rest_binary_body_is_what_the_bridge_decodes():
    """The binary tensor extension framing round-trips through the server's own decoder to the
    same tensors as the gRPC pool (same seed), with binary outputs asked for."""
    from server.transports.rest import codec as rest_codec

    md = _two_input_metadata()
    grpc_pool = build_pool(md, batch=2, size=4, seed=3)
    rest_pool = build_pool(md, batch=2, size=4, seed=3, encoding="rest")
    for raw, (body, headers) in zip(grpc_pool, rest_pool):
        assert headers["Content-Type"] == "application/octet-stream"
        split = rest_codec.header_length(headers[rest_codec.HEADER_LENGTH], len(body))
        decoded, plan = rest_codec.decode_infer_request(body, split, "multi")
        want = pb.ModelInferRequest.FromString(raw)
        assert plan.default_binary is True and not plan.binary
        assert [(t.name, t.datatype, list(t.shape)) for t in decoded.inputs] == [
            ("dense", "FP32", [2, 3]), ("ids", "INT64", [2, 2]), ("text", "BYTES", [2, 1])
        ]
        assert list(decoded.raw_input_contents) == list(want.raw_input_contents)
        assert decoded.id == want.id
        assert "binary_data_output" not in decoded.parameters  # consumed by the bridge
    assert isinstance(rest_pool[0][0], bytes)  # pre-serialized: nothing to build per request


def test_rest_json_body_is_what_the_bridge_decodes(tmp_path):
    from server.transports.rest import codec as rest_codec

    md = _metadata(shape=(-1, 4))
    features = np.random.default_rng(1).standard_normal((10, 4)).astype(np.float32)
    grpc_pool = validation_pool(md, features, batch=3, size=4)
    json_pool = validation_pool(md, features, batch=3, size=4, encoding="rest-json")
    for raw, (body, headers) in zip(grpc_pool, json_pool):
        assert headers == {"Content-Type": "application/json"}
        decoded, plan = rest_codec.decode_infer_request(body, None, "m")
        assert plan.default_binary is False  # JSON outputs too
        want = pb.ModelInferRequest.FromString(raw)
        assert list(decoded.inputs[0].shape) == [3, 4]
        assert decoded.raw_input_contents[0] == want.raw_input_contents[0]  # FP32 exact through JSON
    # BYTES as JSON strings, INT64 as integers
    body, _ = build_pool(_two_input_metadata(), size=1, encoding="rest-json")[0]
    decoded, _ = rest_codec.decode_infer_request(body, None, "multi")
    assert [t.datatype for t in decoded.inputs] == ["FP32", "INT64", "BYTES"]
    with pytest.raises(ValueError, match="encoding"):
        build_pool(md, encoding="xml")


def test_sse_pool_and_target_routing():
    from loadtest.drivers import make_driver
    from loadtest.protocol import GrpcDriver, RestDriver, http_error, metadata_from_json, protocol_of
    from loadtest.request_pool import sse_pool
    from loadtest.sse import DEFAULT_PROMPTS, SSEDriver

    bodies = sse_pool("tiny", ["a", "b"], max_tokens=5, ignore_eos=True)
    docs = [json.loads(b) for b in bodies]
    assert [d["messages"][0]["content"] for d in docs] == ["a", "b"]
    assert all(d["stream"] and d["max_tokens"] == 5 and d["ignore_eos"] and d["model"] == "tiny" for d in docs)
    assert docs[0]["stream_options"] == {"include_usage": True}
    assert len(sse_pool("tiny")) == len(DEFAULT_PROMPTS)

    assert protocol_of("grpc://h:1") == "grpc" and protocol_of("h:1", stream=True) == "grpc-stream"
    assert protocol_of("http://h:1") == "rest" and protocol_of("http://h:1", rest_json=True) == "rest-json"
    assert protocol_of("sse://h:1") == protocol_of("http://h:1", sse=True) == "sse"
    for bad in (dict(target="grpc://h:1", sse=True), dict(target="http://h:1", stream=True), dict(target="ftp://h:1")):
        with pytest.raises(ValueError):
            protocol_of(**bad)

    assert isinstance(make_driver("grpc://h:1"), GrpcDriver)
    rest = make_driver("http://h:1", model="a b", metadata=(("authorization", "Bearer k"),), connections=8)
    assert isinstance(rest, RestDriver) and rest.url == "http://h:1/v2/models/a%20b/infer"
    assert rest.headers == {"authorization": "Bearer k"} and rest.connections == 8
    sse = make_driver("sse://h:1", model="tiny")
    assert isinstance(sse, SSEDriver) and sse.url == "http://h:1/v1/chat/completions"

    e = http_error(429, b'{"error": {"code": "RESOURCE_EXHAUSTED", "message": "quota", "details": []}}')
    assert (e.code, e.message) == ("HTTP 429", "RESOURCE_EXHAUSTED: quota")
    assert http_error(502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"

    md = metadata_from_json({"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]})
    assert random_pool(md, batch=2, size=1, encoding="rest")[0][1]["Inference-Header-Content-Length"]


class FakeHttpServer:
    """An aiohttp app on its own loop in a thread: v2 metadata and infer (every `fail_every`-th
    infer answers 429), and a chat completion stream of `tokens` content events."""

    def __init__(self, fail_every: int = 0, tokens: int = 4, gap_s: float = 0.002) -> None:
        import threading

        from aiohttp import web

        self.fail_every, self.tokens, self.gap_s = fail_every, tokens, gap_s
        self.infers = 0
        self.seen_headers: list[dict] = []
        self.bodies: list[tuple[bytes, dict]] = []
        app = web.Application()
        app.router.add_get("/v2/models/{name}", self.metadata)
        app.router.add_post("/v2/models/{name}/infer", self.infer)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def metadata(self, request):
        from aiohttp import web

        self.seen_headers.append(request.headers.copy())
        return web.json_response(
            {"name": request.match_info["name"], "versions": ["1"], "platform": "fake",
             "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
             "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}]}
        )

    async def infer(self, request):
        from aiohttp import web

        self.infers += 1
        body = await request.read()
        self.bodies[1:] = [(body, request.headers.copy())]  # the first and the latest
        if self.fail_every and self.infers % self.fail_every == 0:
            return web.json_response({"error": {"code": "RESOURCE_EXHAUSTED", "message": "slow down", "details": []}},
                                     status=429)
        return web.json_response({"model_name": "m", "outputs": []})

    async def chat(self, request):
        from aiohttp import web

        doc = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(min(self.tokens, doc["max_tokens"])):
            await asyncio.sleep(self.gap_s)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": self.tokens, "prompt_tokens": 3}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def fake_http():
    servers = []

    def make(**kw) -> FakeHttpServer:
        servers.append(FakeHttpServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_rest_driver_counts_http_errors_and_passes_headers(fake_http):
    from server.transports.rest import codec as rest_codec

    srv = fake_http(fail_every=4)
    target = f"http://127.0.0.1:{srv.port}"
    auth = (("authorization", "Bearer k1"),)
    pool = prepare_pool(target, "m", batch=2, size=8, metadata=auth)  # metadata over GET /v2/models/m
    assert srv.seen_headers[0]["authorization"] == "Bearer k1"
    r = run(_cfg(target, concurrency=2, warmup=0.0, duration=0.6, metadata=auth), pool)
    assert r["protocol"] == "rest"
    total = r["requests"] + r["errors_total"]
    assert total >= 8 and set(r["errors"]) == {"HTTP 429"}  # two fail-every-4 cycles at least
    assert abs(r["errors"]["HTTP 429"]["count"] - total / 4) <= 2
    assert r["errors"]["HTTP 429"]["first_message"] == "RESOURCE_EXHAUSTED: slow down"
    body, headers = srv.bodies[0]
    assert headers["authorization"] == "Bearer k1"
    decoded, _ = rest_codec.decode_infer_request(body, int(headers[rest_codec.HEADER_LENGTH]), "m")
    assert list(decoded.inputs[0].shape) == [2, 4]
    # JSON tensors, open loop, two worker processes
    pool = prepare_pool(target, "m", size=4, rest_json=True)
    r = run(_cfg(target, spec=LoadSpec(rate=100.0, warmup=0.1, duration=0.5), rest_json=True, processes=2), pool)
    assert r["protocol"] == "rest-json" and r["scheduled"] == 50
    assert r["requests"] + r["errors_total"] == 50
    assert b'"data":' in srv.bodies[-1][0] and rest_codec.HEADER_LENGTH not in srv.bodies[-1][1]


def test_sse_driver_reports_ttft_itl_and_tokens(fake_http, tmp_path):
    from typer.testing import CliRunner

    from loadtest.cli import app

    srv = fake_http(tokens=4, gap_s=0.003)
    target = f"sse://127.0.0.1:{srv.port}"
    pool = prepare_pool(target, "tiny", prompts=["hi"], max_tokens=8)
    r = run(_cfg(target, concurrency=2, warmup=0.1, duration=0.5), pool)
    assert r["protocol"] == "sse" and r["errors_total"] == 0
    assert r["streams"] == r["requests"] > 0
    assert r["tokens"] == 4 * r["streams"] and r["tokens_per_stream"] == 4
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / 0.5)
    assert 0 < r["ttft_ms"]["p50"] <= r["latency_ms"]["p50"]
    assert r["itl_ms"]["p50"] >= 2.0  # three 3 ms gaps per stream
    # the CLI with --sse on an http:// target, merged over two processes
    out = tmp_path / "sse.json"
    res = CliRunner().invoke(app, ["run", "-t", f"http://127.0.0.1:{srv.port}", "--sse", "-m", "tiny", "-c", "2",
                                   "-p", "2", "-d", "0.4", "-w", "0.1", "--prompt", "a", "--prompt", "b",
                                   "--max-tokens", "3", "--json", str(out), "-q"])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["protocol"] == "sse" and r["processes"] == 2 and r["streams"] > 2 and r["itl_ms"]["p50"] > 0
    res = CliRunner().invoke(app, ["run", "-t", "grpc://127.0.0.1:1", "--sse", "-m", "tiny", "-q"])
    assert res.exit_code != 0 and "http://" in res.output


def test_the_autoscale_benchmark_reads_each_scale_ups_duration_from_the_decisions():
    decisions = [
        {"action": "up", "reason": "load 3 > 1 x 0.7"}, {"action": "done", "reason": "up to 2 in 1.07s"},
        {"action": "done", "reason": "down to 1 in 0.02s"}, {"action": "done", "reason": "up to 4 in 0.91s"},
        {"action": "failed", "reason": "up to 3: no port"},
    ]  # fmt: skip
    assert scale_up_seconds(decisions) == [1.07, 0.91]


def test_the_autoscale_benchmark_sets_every_autoscaling_run_beside_fixed_max():
    out = {"fixed_max": {"p99_ms": 20.0, "replica_seconds": 320.0}, "autoscaling": {"p99_ms": 50.0, "replica_seconds": 160.0},
           "autoscaling_standby": {"p99_ms": 25.0, "replica_seconds": 240.0, "standby_seconds": 200.0}}  # fmt: skip
    trace_ratios(out)
    assert out["autoscaling_p99_over_fixed_max"] == 2.5 and out["autoscaling_replica_seconds_over_fixed_max"] == 0.5
    assert out["autoscaling_standby_p99_over_fixed_max"] == 1.25 and out["autoscaling_standby_replica_seconds_over_fixed_max"] == 0.75
    assert replica_seconds([(0.0, 3), (10.0, 2)], until=20.0) == 50.0  # a standby count integrates like a replica count


def test_the_autoscale_benchmark_refuses_an_unknown_trace_run(capsys):
    with pytest.raises(SystemExit):
        autoscale_main(["--parts", "trace", "--trace-runs", "fixed_max,warm"])
    assert "unknown warm" in capsys.readouterr().err
