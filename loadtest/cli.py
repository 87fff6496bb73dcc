"""Command line: `python -m loadtest run|compare|delay-check|sweep|perf-analyzer ...` (typer app `app`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from loadtest.engine import LoadSpec

app = typer.Typer(
    name="loadtest",
    help="Load generator for OIP v2 gRPC, KServe v2 REST and SSE token-stream targets (Triton, the inferplane frontend).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # help texts as written: rich would turn codes like :end: into emoji
)

Target = Annotated[str, typer.Option("--target", "-t", help="grpc://HOST:PORT, http://HOST:PORT (REST) or sse://HOST:PORT")]
Model = Annotated[str, typer.Option("--model", "-m", help="model name")]
Concurrency = Annotated[int | None, typer.Option("--concurrency", "-c", help="closed loop: N concurrent callers")]
Rate = Annotated[float | None, typer.Option("--rate", "-r", help="open loop: requests/s")]
Poisson = Annotated[bool, typer.Option("--poisson", help="open loop with Poisson arrivals")]
Duration = Annotated[float, typer.Option("--duration", "-d", help="measured seconds")]
Warmup = Annotated[float, typer.Option("--warmup", "-w", help="warm-up seconds (excluded)")]
Data = Annotated[str, typer.Option("--data", help="validation | random")]
Repository = Annotated[str | None, typer.Option("--repository", help="model repository (for --data validation)")]
Batch = Annotated[int, typer.Option("--batch", "-b", help="batch size (replaces -1 dims)")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="write the JSON result here")]
Pids = Annotated[list[int] | None, typer.Option("--pid", help="process under test (repeatable): CPU per request")]
Stream = Annotated[bool, typer.Option("--stream", help="use ModelStreamInfer (bidi) instead of ModelInfer")]
Processes = Annotated[int, typer.Option("--processes", "-p", help="client worker processes")]
Channels = Annotated[int, typer.Option("--channels", help="gRPC channels (TCP connections) per process")]
Headers = Annotated[list[str] | None, typer.Option("--header", "-H", help="gRPC metadata / HTTP header KEY=VALUE (repeatable)")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar or summary")]
PoolSize = Annotated[int, typer.Option("--pool-size", help="distinct pre-serialized requests")]
Timeout = Annotated[float, typer.Option("--timeout", help="per-request deadline, seconds")]
MaxInflight = Annotated[int, typer.Option("--max-inflight", help="open loop: cap on outstanding requests")]
Seed = Annotated[int, typer.Option("--seed")]
HonorRetryAfter = Annotated[bool, typer.Option("--honor-retry-after", help="closed loop: a caller refused with a retry hint waits it out before its next call")]
RestJson = Annotated[bool, typer.Option("--rest-json", help="http:// targets: JSON tensors instead of the binary extension")]
Sse = Annotated[bool, typer.Option("--sse", help="http:// targets: stream /v1/chat/completions (like sse://)")]
Prompts = Annotated[list[str] | None, typer.Option("--prompt", help="SSE: prompt text (repeatable; default: a built-in set)")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="SSE: max_tokens per completion")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="SSE: ask for exactly --max-tokens tokens (server extension)")]


def _headers(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items or []:
        if "=" not in item:
            raise typer.BadParameter(f"header {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        out.append((k.strip().lower(), v.strip()))
    return tuple(out)


def _check_protocol(cfg) -> str:
    try:
        return cfg.protocol
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _http_flags(target: str, rest_json: bool, sse: bool) -> dict:
    """--rest-json/--sse apply to http(s):// targets only (compare/sweep may mix protocols)."""
    if target.startswith(("http://", "https://")):
        return {"rest_json": rest_json, "sse": sse}
    return {}


def _proto_kw(rest_json: bool, sse: bool, prompts, max_tokens: int, ignore_eos: bool) -> dict:
    return dict(rest_json=rest_json, sse=sse, prompts=prompts, max_tokens=max_tokens, ignore_eos=ignore_eos)


def _spec(concurrency, rate, poisson, warmup, duration, max_inflight, seed, honor_retry_after: bool = False) -> LoadSpec:
    if concurrency is None and rate is None:
        concurrency = 1
    if concurrency is not None and rate is not None:
        raise typer.BadParameter("give --concurrency or --rate, not both")
    if poisson and rate is None:
        raise typer.BadParameter("--poisson needs --rate")
    return LoadSpec(
        concurrency=concurrency, rate=rate, poisson=poisson, warmup=warmup, duration=duration,
        max_inflight=max_inflight, seed=seed, honor_retry_after=honor_retry_after,
    )


def _emit(result: dict, json_out: Path | None, quiet: bool) -> None:
    text = json.dumps(result, indent=2, default=str)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")
        if not quiet:
            typer.echo(f"wrote {json_out}", err=True)
    else:
        typer.echo(text)


def _summary_line(r: dict) -> str:
    lat = r["latency_ms"]
    cpu = (r.get("cpu") or {}).get("total_cpu_ms_per_request")
    cpu_s = f" cpu/req {cpu:.3f} ms" if cpu is not None else ""
    line = (
        f"{r['throughput_rps']:.1f} req/s  p50 {lat['p50']:.3f}  p90 {lat['p90']:.3f}  p99 {lat['p99']:.3f}"
        f"  p99.9 {lat['p99.9']:.3f}  max {lat['max']:.3f} ms  errors {r['errors_total']}{cpu_s}"
    )
    if "ttft_ms" in r:
        ttft, itl = r["ttft_ms"], r["itl_ms"]
        line += (
            f"\n  {r['tokens_per_s']:.1f} tokens/s  ttft p50 {ttft['p50']:.3f} p99 {ttft['p99']:.3f} ms"
            f"  itl p50 {itl['p50']:.3f} p99 {itl['p99']:.3f} ms  {r['tokens_per_stream']:.1f} tokens/stream"
        )
    return line


_SCHEMES = ("grpc://", "http://", "https://", "sse://")


def _parse_labeled(target: str, default: str) -> tuple[str, str]:
    """'label=grpc://h:p' or 'grpc://h:p' (also http://, https://, sse://) -> (label, target)."""
    if "=" in target and not target.startswith(_SCHEMES):
        label, t = target.split("=", 1)
        return label, t
    return default, target


@app.command()
def run(
    target: Target,
    model: Model,
    concurrency: Concurrency = None,
    rate: Rate = None,
    poisson: Poisson = False,
    duration: Duration = 10.0,
    warmup: Warmup = 2.0,
    data: Data = "random",
    repository: Repository = None,
    batch: Batch = 1,
    json_out: JsonOut = None,
    pid: Pids = None,
    stream: Stream = False,
    processes: Processes = 1,
    channels: Channels = 1,
    header: Headers = None,
    quiet: Quiet = False,
    pool_size: PoolSize = 64,
    timeout: Timeout = 30.0,
    max_inflight: MaxInflight = 10_000,
    seed: Seed = 0,
    rest_json: RestJson = False,
    sse: Sse = False,
    prompt: Prompts = None,
    max_tokens: MaxTokens = 64,
    ignore_eos: IgnoreEos = False,
    honor_retry_after: HonorRetryAfter = False,
) -> None:
    """One measured run (closed loop with --concurrency, open loop with --rate)."""
    from loadtest.runner import RunConfig, prepare_pool
    from loadtest.runner import run as do_run

    if honor_retry_after and rate is not None:
        raise typer.BadParameter("--honor-retry-after is for the closed loop (--concurrency)")
    spec = _spec(concurrency, rate, poisson, warmup, duration, max_inflight, seed, honor_retry_after)
    md = _headers(header)
    cfg = RunConfig(
        target=target, model=model, spec=spec, stream=stream, channels=channels, timeout=timeout,
        metadata=md, processes=processes, batch=batch, pids=tuple(pid or ()), rest_json=rest_json, sse=sse,
    )
    _check_protocol(cfg)
    pool = prepare_pool(target, model, data=data, repository=repository, batch=batch, size=pool_size, seed=seed,
                        metadata=md, **_proto_kw(rest_json, sse, prompt, max_tokens, ignore_eos))
    result = do_run(cfg, pool, quiet=quiet)
    result["data"] = "prompts" if result["protocol"] == "sse" else data
    if not quiet:
        typer.echo(_summary_line(result), err=True)
        for code, e in result["errors"].items():
            typer.echo(f"  {code}: {e['count']} (first: {e['first_message']})", err=True)
    _emit(result, json_out, quiet)


@app.command()
def compare(
    target_a: Annotated[str, typer.Argument(help="A (baseline), e.g. direct Triton: [label=]grpc://HOST:PORT (or http://, sse://)")],
    target_b: Annotated[str, typer.Argument(help="B, e.g. through the frontend: [label=]grpc://HOST:PORT (or http://, sse://)")],
    model: Model,
    rounds: Annotated[int, typer.Option("--rounds", help="interleaved rounds A, B, A, B, ...")] = 6,
    concurrency: Concurrency = None,
    rate: Rate = None,
    poisson: Poisson = False,
    duration: Duration = 5.0,
    warmup: Warmup = 1.0,
    data: Data = "random",
    repository: Repository = None,
    batch: Batch = 1,
    json_out: JsonOut = None,
    pid_a: Annotated[list[int] | None, typer.Option("--pid-a", help="processes serving A (repeatable)")] = None,
    pid_b: Annotated[list[int] | None, typer.Option("--pid-b", help="processes serving B (repeatable)")] = None,
    stream: Stream = False,
    processes: Processes = 1,
    channels: Channels = 1,
    header_a: Annotated[list[str] | None, typer.Option("--header-a", help="gRPC metadata for A")] = None,
    header_b: Annotated[list[str] | None, typer.Option("--header-b", help="gRPC metadata for B")] = None,
    quiet: Quiet = False,
    pool_size: PoolSize = 64,
    timeout: Timeout = 30.0,
    max_inflight: MaxInflight = 10_000,
    seed: Seed = 0,
    rest_json: RestJson = False,
    sse: Sse = False,
    prompt: Prompts = None,
    max_tokens: MaxTokens = 64,
    ignore_eos: IgnoreEos = False,
) -> None:
    """Same load against A and B in interleaved rounds; reports B/A ratios with spread.

    A and B may speak different protocols (e.g. grpc:// vs http://); --rest-json/--sse apply
    to whichever is an http:// target."""
    from loadtest.compare import compare as do_compare
    from loadtest.runner import RunConfig, prepare_pool

    spec = _spec(concurrency, rate, poisson, warmup, duration, max_inflight, seed)
    (label_a, ta), (label_b, tb) = _parse_labeled(target_a, "A"), _parse_labeled(target_b, "B")
    md_a, md_b = _headers(header_a), _headers(header_b)
    common = dict(model=model, spec=spec, stream=stream, channels=channels, timeout=timeout, processes=processes, batch=batch)
    cfg_a = RunConfig(target=ta, metadata=md_a, pids=tuple(pid_a or ()), label=label_a, **common, **_http_flags(ta, rest_json, sse))
    cfg_b = RunConfig(target=tb, metadata=md_b, pids=tuple(pid_b or ()), label=label_b, **common, **_http_flags(tb, rest_json, sse))
    _check_protocol(cfg_a)
    _check_protocol(cfg_b)
    kw = dict(data=data, repository=repository, batch=batch, size=pool_size, seed=seed)
    pool_a = prepare_pool(ta, model, metadata=md_a, **kw, **_proto_kw(cfg_a.rest_json, cfg_a.sse, prompt, max_tokens, ignore_eos))
    pool_b = prepare_pool(tb, model, metadata=md_b, **kw, **_proto_kw(cfg_b.rest_json, cfg_b.sse, prompt, max_tokens, ignore_eos))

    def on_round(i: int, ra: dict, rb: dict) -> None:
        if not quiet:
            typer.echo(f"round {i + 1}/{rounds}\n  {label_a}: {_summary_line(ra)}\n  {label_b}: {_summary_line(rb)}", err=True)

    result = do_compare(cfg_a, cfg_b, pool_a, pool_b, rounds=rounds, quiet=quiet, on_round=on_round)
    if not quiet:
        _print_compare(result)
    _emit(result, json_out, quiet)


def _print_compare(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result["summary"]
    t = Table(title=f"{result['b']['label']} / {result['a']['label']} over {result['rounds']} rounds")
    for col in ("figure", "A median", "B median", "B/A median", "B/A min–max", "B−A median"):
        t.add_column(col, justify="right")

    def f(v):
        return "-" if v is None else f"{v:.4g}"

    for name, ratio in s["ratio_b_over_a"].items():
        diff = s["diff_b_minus_a"][name]
        t.add_row(
            name, f(s["a"][name]["median"]), f(s["b"][name]["median"]), f(ratio["median"]),
            f"{f(ratio['min'])}–{f(ratio['max'])}", f(diff["median"]),
        )
    Console(stderr=True).print(t)


@app.command("delay-check")
def delay_check_cmd(
    delay_ms: Annotated[float, typer.Option("--delay-ms", help="the delay server B adds to each answer")] = 2.0,
    rounds: Annotated[int, typer.Option("--rounds", help="interleaved rounds A, B, A, B, ...")] = 6,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="closed loop: N concurrent callers")] = 2,
    duration: Duration = 2.0,
    warmup: Warmup = 0.5,
    tolerance_ms: Annotated[float, typer.Option("--tolerance-ms", help="exit 1 when the median B-A p50 is further from the delay")] = 1.0,
    json_out: JsonOut = None,
    quiet: Quiet = False,
) -> None:
    """compare() against two local dummy servers, B adding --delay-ms: the B-A p50 it measures (a benchmark)."""
    from loadtest.delay_check import delay_check

    result = delay_check(delay_ms, rounds=rounds, concurrency=concurrency, warmup=warmup, duration=duration, tolerance_ms=tolerance_ms)
    check = result["delay_check"]
    if not quiet:
        _print_compare(result)
        diff = check["diff_p50_ms"]
        typer.echo(
            f"B-A p50: median {diff['median']:.3f} ms (min {diff['min']:.3f}, max {diff['max']:.3f}) for a {delay_ms:g} ms delay;"
            f" {'within' if check['within'] else 'NOT within'} {tolerance_ms:g} ms; load average {check['load_average_before'][0]:.2f}"
            f" -> {check['load_average_after'][0]:.2f}",
            err=True,
        )
    _emit(result, json_out, quiet)
    if not check["within"]:
        raise typer.Exit(1)


def _levels(text: str) -> list[float]:
    return [float(x) for x in text.replace(" ", "").split(",") if x]


@app.command()
def sweep(
    target: Annotated[list[str], typer.Option("--target", "-t", help="[label=]grpc://HOST:PORT, http://HOST:PORT or sse://HOST:PORT (repeatable)")],
    model: Model,
    concurrency: Annotated[str | None, typer.Option("--concurrency", "-c", help="levels, e.g. 1,2,4,8,16")] = None,
    rate: Annotated[str | None, typer.Option("--rate", "-r", help="levels in req/s, e.g. 100,500,1000")] = None,
    poisson: Poisson = False,
    duration: Duration = 5.0,
    warmup: Warmup = 1.0,
    data: Data = "random",
    repository: Repository = None,
    batch: Batch = 1,
    json_out: JsonOut = None,
    png: Annotated[Path, typer.Option("--png", help="chart output")] = Path("sweep.png"),
    stream: Stream = False,
    processes: Processes = 1,
    channels: Channels = 1,
    header: Headers = None,
    quiet: Quiet = False,
    pool_size: PoolSize = 64,
    timeout: Timeout = 30.0,
    max_inflight: MaxInflight = 10_000,
    seed: Seed = 0,
    rest_json: RestJson = False,
    sse: Sse = False,
    prompt: Prompts = None,
    max_tokens: MaxTokens = 64,
    ignore_eos: IgnoreEos = False,
) -> None:
    """Concurrency or rate sweep; writes a latency-vs-throughput PNG and JSON."""
    from loadtest.runner import RunConfig, prepare_pool
    from loadtest.sweep import plot
    from loadtest.sweep import sweep as do_sweep

    if (concurrency is None) == (rate is None):
        raise typer.BadParameter("give --concurrency LEVELS or --rate LEVELS")
    conc = [int(x) for x in _levels(concurrency)] if concurrency else None
    rates = _levels(rate) if rate else None
    spec = _spec(conc[0] if conc else None, rates[0] if rates else None, poisson, warmup, duration, max_inflight, seed)
    md = _headers(header)
    cfgs, pools = [], []
    for i, t in enumerate(target):
        label, addr = _parse_labeled(t, t)
        cfg = RunConfig(target=addr, model=model, spec=spec, stream=stream, channels=channels, timeout=timeout,
                        metadata=md, processes=processes, batch=batch, label=label, **_http_flags(addr, rest_json, sse))
        _check_protocol(cfg)
        cfgs.append(cfg)
        pools.append(prepare_pool(addr, model, data=data, repository=repository, batch=batch, size=pool_size, seed=seed,
                                  metadata=md, **_proto_kw(cfg.rest_json, cfg.sse, prompt, max_tokens, ignore_eos)))

    def on_point(c, r) -> None:
        if not quiet:
            level = c.spec.concurrency if conc else c.spec.rate
            typer.echo(f"{c.label} @ {level}: {_summary_line(r)}", err=True)

    result = do_sweep(cfgs, pools, concurrencies=conc, rates=rates, quiet=quiet, on_point=on_point)
    result["png"] = str(plot(result, png))
    if not quiet:
        typer.echo(f"wrote {png}", err=True)
    _emit(result, json_out, quiet)


@app.command("perf-analyzer")
def perf_analyzer_cmd(
    target: Target,
    model: Model,
    concurrency_range: Annotated[str, typer.Option("--concurrency-range", help="N, or START:END:STEP (e.g. 1:32:8)")] = "1",
    measurement_interval: Annotated[int, typer.Option("--measurement-interval", help="ms per measurement")] = 5000,
    batch: Batch = 1,
    json_out: JsonOut = None,
    quiet: Quiet = False,
    extra: Annotated[list[str] | None, typer.Option("--extra", help="extra perf_analyzer argument (repeatable)")] = None,
    ensure_only: Annotated[
        bool, typer.Option("--ensure-only", help="only fetch the binary and print a script that runs it on its own")
    ] = False,
) -> None:
    """Run NVIDIA perf_analyzer (from the tritonclient 2.51.0 wheel) and emit loadtest JSON."""
    from loadtest import perf_analyzer as pa

    if ensure_only:
        typer.echo(str(pa.wrapper_script()))
        return
    result = pa.run_perf_analyzer(
        target, model, concurrency_range=concurrency_range, measurement_interval_ms=measurement_interval,
        batch=batch, extra_args=list(extra or ()),
    )
    if not quiet:
        for p in result["points"]:
            lat = p["latency_ms"]
            typer.echo(
                f"c={p.get('concurrency')}: {p['throughput_rps']:.1f} req/s  p50 {lat['p50']:.3f}  "
                f"p90 {lat['p90']:.3f}  p95 {lat['p95']:.3f}  p99 {lat['p99']:.3f} ms",
                err=True,
            )
    _emit(result, json_out, quiet)


def mount(parent: typer.Typer) -> None:
    """``inferplane loadtest ...`` (an ``inferplane.cli`` entry point)."""
    parent.add_typer(app, name="loadtest", help="Load generators and benchmarks (closed/open loop, compare, sweep).")


def main() -> None:
    app(prog_name="loadtest")


if __name__ == "__main__":
    sys.exit(main())
