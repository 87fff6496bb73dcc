"""Pure logic of observability: bounded tenant labels, sampling rings, the trace decision (no span for an
unsampled request), the coalescer's per-call hook, SLO budgets from counters, PSI / KS, payload
redaction, and the Grafana dashboard naming only metrics the frontend exports."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest

from batching.coalescer import CoalescePolicy, Coalescer
from server.control.monitoring import slo, token_slo
from server.control.monitoring.dashboard import PANELS, dashboard
from server.control.monitoring.drift import FeatureReference, ks, psi
from server.control.monitoring.payload_log import REDACTED, Redaction, build_record, parse_path
from server.dataplane.batch_codec import CODEC
from server.dataplane.metrics import OTHER_LABEL, Metrics
from server.dataplane.observe import Observer, SampleRing, TopLabels
from server.dataplane.tracing import Tracing, format_traceparent, outgoing_metadata, parse_traceparent
from server.protogen.inference import grpc_service_pb2 as pb


# ---- labels and rings ------------------------------------------------------------------------------


def test_top_labels_keep_the_busiest_names_and_fold_the_rest():
    now = [0.0]
    dropped = []
    labels = TopLabels(2, 60.0, clock=lambda: now[0], on_drop=dropped.append)
    assert [labels.label(n) for n in ("a", "b", "c")] == ["a", "b", OTHER_LABEL]
    for _ in range(50):
        labels.label("c")
    now[0] = 61.0
    assert labels.refresh() == {"b"}  # c overtook b
    assert labels.label("c") == "c" and labels.label("b") == OTHER_LABEL and labels.label("a") == "a"
    assert dropped == [{"b"}]
    assert TopLabels(0).label("x") == OTHER_LABEL


def test_rings_are_bounded():
    ring = SampleRing(2, overwrite=True)
    for i in range(5):
        ring.put(i)
    assert ring.drain() == [3, 4] and ring.dropped == 3
    queue = SampleRing(2, overwrite=False)
    assert [queue.put(i) for i in range(3)] == [True, True, False]
    assert queue.drain() == [0, 1]


# ---- tracing -----------------------------------------------------------------------------------------


def test_traceparent_parsing():
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parse_traceparent(f"00-{tid}-{sid}-01") == (int(tid, 16), int(sid, 16), True)
    assert parse_traceparent(f"00-{tid}-{sid}-00")[2] is False
    for bad in (None, "", "garbage", f"00-{'0' * 32}-{sid}-01", f"ff-{tid}-{sid}-01", f"00-{tid}-{sid}-zz"):
        assert parse_traceparent(bad) is None
    assert format_traceparent(int(tid, 16), int(sid, 16)) == f"00-{tid}-{sid}-01"


class _Ctx:
    def __init__(self, headers):
        self.headers = headers


class _Call:
    def __init__(self, headers=()):
        self.ctx = _Ctx(headers)
        self.kind = "infer"


def _tracing(ratio, draws):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    it = iter(draws)
    return Tracing(provider.get_tracer("t"), ratio, rand=lambda: next(it)), exporter


def test_the_sampling_decision_makes_no_span_for_an_unsampled_request():
    tracing, exporter = _tracing(0.01, [0.5, 0.005])
    assert tracing.begin(_Call()) is None  # 0.5 >= 1 %
    trace = tracing.begin(_Call())  # 0.005 < 1 %
    assert trace is not None
    sid = "00f067aa0ba902b7"
    assert tracing.begin(_Call((("traceparent", f"00-{'a' * 32}-{sid}-00"),))) is None  # the caller said no
    followed = tracing.begin(_Call((("traceparent", f"00-{'a' * 32}-{sid}-01"),)))
    assert followed.span.get_span_context().trace_id == int("a" * 32, 16)
    assert exporter.get_finished_spans() == ()  # nothing ends before the request does


def test_a_traced_batch_sends_its_traceparent_and_resets_it():
    tracing, exporter = _tracing(1.0, [0.0, 0.0])
    a, b = tracing.begin(_Call()), tracing.begin(_Call())
    ra, rb, rc = pb.ModelInferRequest(model_name="m"), pb.ModelInferRequest(model_name="m"), pb.ModelInferRequest(model_name="m")
    a.submitting(ra)
    b.submitting(rb)
    assert tracing.on_batch([rc], 1, "r") is None  # no traced member: nothing
    done = tracing.on_batch([ra, rb, rc], 3, "replica-1")
    sent = outgoing_metadata()
    assert sent[0][0] == "traceparent" and sent[0][1].startswith(f"00-{a.span.get_span_context().trace_id:032x}-")
    done(None)
    assert outgoing_metadata() is None
    (call,) = exporter.get_finished_spans()
    assert call.name == "triton infer" and call.parent.span_id == a.span.get_span_context().span_id
    assert [link.context.span_id for link in call.links] == [b.span.get_span_context().span_id]
    assert call.attributes["inferplane.batch.requests"] == 3 and a.batch[0] == b.batch[0] == call.attributes["inferplane.batch.id"]


# ---- the coalescer's per-call hook --------------------------------------------------------------------


def _request(rows: int) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name="x", datatype="FP32", shape=[rows, 2])
    r.raw_input_contents.append(np.zeros((rows, 2), np.float32).tobytes())
    return r


async def test_the_coalescer_reports_every_call_with_its_rows():
    seen, finished = [], []

    async def send(raw, timeout, request):
        await asyncio.sleep(0.001)
        merged = pb.ModelInferRequest.FromString(raw)
        rows = merged.inputs[0].shape[0]
        answer = pb.ModelInferResponse(model_name="m")
        answer.outputs.add(name="y", datatype="FP32", shape=[rows, 1])
        answer.raw_output_contents.append(np.zeros((rows, 1), np.float32).tobytes())
        return answer.SerializeToString()

    def on_call(requests, rows):
        seen.append((len(requests), rows))
        return finished.append

    coalescer = Coalescer(send, CODEC, on_call=on_call)
    policy = CoalescePolicy(enabled=True, max_inflight=1, max_batch=64)
    requests = [_request(n) for n in (1, 2, 3, 4)]
    await asyncio.gather(*(coalescer.submit(r, r.SerializeToString(), policy) for r in requests))
    assert sum(n for n, _ in seen) == 4 and sum(rows for _, rows in seen) == 10
    assert finished == [None] * len(seen)
    await coalescer.submit(requests[0], requests[0].SerializeToString(), CoalescePolicy(enabled=False))
    assert seen[-1] == (1, 1)


def test_observer_counts_rows_per_call_by_model():
    metrics = Metrics()
    observer = Observer(metrics)
    assert observer.on_batch([_request(2), _request(3)], 5) is None
    assert metrics.registry.get_sample_value("inferplane_batch_rows_sum", {"model": "m"}) == 5
    assert metrics.registry.get_sample_value("inferplane_batch_requests_sum", {"model": "m"}) == 2


# ---- SLOs --------------------------------------------------------------------------------------------


METRICS_TEXT = """
inferplane_requests_total{model="m",version="1",code="OK"} 990
inferplane_requests_total{model="m",version="1",code="INTERNAL"} 5
inferplane_requests_total{model="m",version="1",code="INVALID_ARGUMENT"} 5
inferplane_requests_total{model="_unknown",version="",code="NOT_FOUND"} 7
inferplane_admissions_total{model="m",path="refused"} 5
inferplane_request_duration_seconds_bucket{model="m",le="0.05"} 900
inferplane_request_duration_seconds_bucket{model="m",le="0.1"} 980
inferplane_request_duration_seconds_bucket{model="m",le="+Inf"} 1000
inferplane_request_duration_seconds_count{model="m"} 1000
inferplane_request_duration_seconds_sum{model="m"} 20
"""


def test_counts_and_budget_from_metrics_text():
    counts = slo.read_counts(METRICS_TEXT)
    assert set(counts) == {"m"}
    c = counts["m"]
    assert (c.total, c.bad, c.observed, c.fast(0.1)) == (1000, 10, 1000, 980)
    availability, latency = slo.budget(slo.Objective("m", 0.999, 0.1, 0.99), c, None, 3600)
    assert availability.good_ratio == pytest.approx(0.99) and availability.budget_remaining == pytest.approx(1 - 0.01 / 0.001)
    assert latency.good_ratio == pytest.approx(0.98) and latency.budget_remaining == pytest.approx(1 - 0.02 / 0.01)


def test_tracker_uses_the_window_and_survives_a_counter_reset():
    now = [0.0]
    readings = [slo.Counts(100, 0, 100, ((0.1, 100.0),))]
    metrics = Metrics()
    tracker = slo.SLOTracker(lambda: readings[-1], lambda: {"m": slo.Objective("m", 0.99)}, metrics, window_s=100, points=10, clock=lambda: now[0])
    tracker.readings_source = None
    tracker._read = lambda: {"m": readings[-1]}
    tracker.step()
    now[0] = 150.0
    readings.append(slo.Counts(200, 10, 200, ((0.1, 200.0),)))
    statuses = {s.slo: s for s in tracker.step()}
    # the window's base is the reading at t=0: 100 requests, 10 bad
    assert statuses["availability"].good_ratio == pytest.approx(0.9) and statuses["availability"].requests == 100
    assert metrics.registry.get_sample_value("inferplane_slo_error_budget_remaining", {"model": "m", "slo": "availability"}) == pytest.approx(1 - 0.1 / 0.01)
    assert slo._delta(5, 100) == 5  # a restart: the counter started again


# ---- drift -------------------------------------------------------------------------------------------


def test_psi_and_ks_tell_a_shift_from_noise():
    rng = np.random.default_rng(0)
    reference = FeatureReference(rng.normal(0, 1, 2000))
    same = rng.normal(0, 1, 1000)
    moved = rng.normal(1.5, 1, 1000)
    assert psi(reference, same) < 0.05 and ks(reference, same)[0] < 0.08
    assert psi(reference, moved) > 0.25 and ks(reference, moved)[0] > 0.4
    constant = FeatureReference(np.ones(100))
    assert psi(constant, np.ones(50)) == pytest.approx(0.0, abs=1e-9)


# ---- payload redaction -------------------------------------------------------------------------------


class _Sample:
    def __init__(self, request, answer=None, headers=()):
        self.at, self.model, self.version, self.kind, self.code = 0.0, "m", "1", "infer", "OK"
        self.tenant, self.team, self.key_id, self.latency_s = "t", "team", "abcd1234", 0.001
        self.request, self.answer, self.headers = request, answer, headers


def test_redaction_by_tensor_path_and_regex_and_keys_always():
    key = "ipk_abcd1234_" + "s" * 43
    request = pb.ModelInferRequest(model_name="m", id=f"order-4111111111111111 {key}")
    request.inputs.add(name="card", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.array([[1, 2]], np.float32).tobytes())
    request.inputs.add(name="amount", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.array([[3.5]], np.float32).tobytes())
    headers = (("authorization", f"Bearer {key}"), ("x-api-key", key), ("x-user", "u1"), ("x-note", f"token Bearer {key}"))
    params = {"inferplane.payload_log_redact_tensors": "card", "inferplane.payload_log_redact_paths": "$.headers.x-user",
              "inferplane.payload_log_redact_regex": json.dumps([r"\d{16}"])}  # fmt: skip
    record = build_record(_Sample(request, headers=headers), Redaction.from_params(params))
    text = json.dumps(record)
    assert key not in text and "authorization" not in text and "x-api-key" not in text and "4111111111111111" not in text
    inputs = {t["name"]: t for t in record["request"]["inputs"]}
    assert inputs["card"]["data"] == REDACTED and inputs["amount"]["data"] == [3.5]
    assert record["headers"]["x-user"] == REDACTED and record["headers"]["x-note"] == f"token {REDACTED}"
    assert parse_path("$.request.inputs[*].data") == ("request", "inputs", "*", "data")
    with pytest.raises(ValueError):
        parse_path("request.inputs")


# ---- the dashboard -----------------------------------------------------------------------------------

_PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "max", "min", "on", "increase", "le", "model", "code", "tenant",
                 "path", "phase", "slo", "generation", "team", "gpu", "group_left"}  # fmt: skip


def test_every_dashboard_query_names_an_exported_metric_or_recording_rule():
    exported = set(Metrics().names())
    recorded = {r["record"] for g in slo.rules([slo.Objective("m")])["groups"] + token_slo.rules()["groups"] for r in g["rules"] if "record" in r}
    doc = dashboard()
    assert len(doc["panels"]) == len(PANELS)
    for panel in doc["panels"]:
        for target in panel["targets"]:
            expr = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', "", target["expr"])
            names = {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in _PROMQL_WORDS}
            assert names, target["expr"]
            for name in names:
                assert name in exported or name in recorded, f"panel {panel['title']!r}: {name} is not exported"
    on_disk = json.loads((__import__("pathlib").Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "inferplane.json").read_text())
    assert on_disk == doc, "deploy/grafana/inferplane.json is stale: regenerate it with `inferplane dashboard --out deploy/grafana/inferplane.json`"


def test_every_panel_that_breaks_a_series_down_by_model_follows_the_model_variable():
    """The dashboard's $model picks the models every per-model panel shows (the token panels once ignored it)."""
    by_model = [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"] if "by (model" in t["expr"]]
    assert len(by_model) >= 10
    assert [title for title, expr in by_model if '$model' not in expr] == []


def test_payload_log_keeps_within_its_retention_limit(tmp_path):
    from server.control.monitoring.payload_log import PayloadLog

    metrics = Metrics()
    request = pb.ModelInferRequest(model_name="m", id="r")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.zeros((1, 1), np.float32).tobytes())
    log = PayloadLog(None, metrics, str(tmp_path / "p"), lambda name: Redaction(), max_records=3, file_records=2)
    assert not (tmp_path / "p").exists()  # nothing written, nothing created
    for _ in range(4):
        log.write([_Sample(request), _Sample(request)])
    files = sorted((tmp_path / "p").glob("payloads-*.jsonl"))
    kept = sum(len(f.read_text().splitlines()) for f in files)
    assert len(files) == 1 and kept == 2  # older files deleted once over 3 records
    assert log.written == 8 and metrics.registry.get_sample_value("inferplane_payload_logged_total", {"model": "m"}) == 8
