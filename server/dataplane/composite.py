"""Composite endpoints in the data plane: the plans it serves and the frontend's DAG executor.

A composite (``server.control.composition.composition``) is compiled (``server.control.composition.composition_compiler``)
into a *plan* per version. The data plane serves a composite under its own name, with the
signature derived from its members, through the one pipeline like any model (auth, grants,
traffic splits between composite versions, quotas, validation, the fair queue):

* **ensemble** plans: the request goes on to the version's Triton ensemble (``NAME__vV``) as one
  call (the caller's bytes with the model name appended, coalesced like any model's); Triton runs
  the steps. Per-node figures are Triton's statistics of each step model; Triton's own trace
  spans of the steps join the request's trace.
* **dag** plans: the frontend runs the nodes, independent ones concurrently. Each model or
  operator node is one ``infer`` call of the model port (``server.dataplane.port``; the pipeline
  again: quota, metering, metrics and a trace span per node, grants checked against the
  composite), an endpoint node one embeddings / generation call of the LLM service (over the same
  port), a router a decision made here (each row only runs its branch), an aggregator with a
  quorum policy answers from the members that answered.
  Per node: ``inferplane_composite_node_requests_total{composite,node,code}`` and
  ``inferplane_composite_node_duration_seconds{composite,node}``; with tracing, a span
  ``node NAME`` under the composite's request span, parent of that node's own request span.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import Counter, Histogram

from batching.coalescer import CoalescePolicy
from server.dataplane import codecs
from server.dataplane.generation import LLMService
from server.dataplane.metrics import LATENCY_BUCKETS
from server.dataplane.port import Answered, GenerateParams, ModelPort
from server.dataplane.signature import ModelSignature, TensorSpec, version_key
from server.dataplane.wire import rename
from server.errors import (
    BackendError,
    BackendUnavailable,
    DeadlineExceeded,
    InferplaneError,
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    Violation,
    public_message,
)
from server.protogen.inference import grpc_service_pb2 as pb
from server.protogen.inference import model_config_pb2
from server.tenancy.identity import CallContext, Delegation
from server.dataplane.tracing import format_traceparent

log = logging.getLogger(__name__)

ENSEMBLE, DAG = "ensemble", "dag"
PLAN_SUFFIX = ".composite.json"
PLATFORM = "inferplane_composite"
# the traceparent a node call of an untraced composite carries: "not sampled" (no orphan traces)
_UNSAMPLED = "00-" + "1" * 32 + "-" + "1" * 16 + "-00"


# ---- plans ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodePlan:
    name: str
    kind: str  # model | op | router | endpoint
    outputs: Mapping[str, tuple[str, tuple[int, ...]]]  # tensor -> (datatype, dims)
    model: str = ""  # the Triton model (member or operator) or the endpoint's model
    version: str = ""
    inputs: Mapping[str, str] = field(default_factory=dict)  # the model's input -> tensor ref
    gated_by: str | None = None  # the router whose branch this is
    op: str = ""
    on_failure: str = "fail"
    quorum: int = 0
    key: str = ""  # a router's key tensor
    routes: Mapping[str, str] = field(default_factory=dict)
    default: str | None = None
    endpoint: str = ""  # embeddings | completions | chat
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def sources(self) -> list[str]:
        """The nodes this one reads from (a router: its key's)."""
        refs = [self.key] if self.kind == "router" else list(self.inputs.values())
        return [r.split(".", 1)[0] for r in refs if "." in r]


@dataclass(frozen=True)
class Plan:
    name: str
    version: str
    mode: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[tuple[str, str, tuple[int, ...], str], ...]  # (name, datatype, dims, source ref)
    nodes: tuple[NodePlan, ...]
    triton_model: str = ""  # ensemble plans: the Triton ensemble
    triton_models: tuple[str, ...] = ()  # every Triton model the plan owns (operators, the ensemble)
    members: tuple[dict, ...] = ()
    reasons: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "Plan":
        nodes = []
        for n in doc["nodes"]:
            outs = {t: (v["datatype"], tuple(v["dims"])) for t, v in n.get("outputs", {}).items()}
            nodes.append(NodePlan(
                name=n["name"], kind=n["kind"], outputs=outs, model=n.get("model", ""), version=str(n.get("version") or ""),
                inputs=dict(n.get("inputs", {})), gated_by=n.get("gated_by"), op=n.get("op", ""), on_failure=n.get("on_failure", "fail"),
                quorum=int(n.get("quorum") or 0), key=n.get("key", ""), routes=dict(n.get("routes", {})), default=n.get("default"),
                endpoint=n.get("endpoint", ""), params=dict(n.get("params", {})),
            ))  # fmt: skip
        return cls(
            name=doc["name"], version=str(doc["version"]), mode=doc["mode"], max_batch_size=int(doc["max_batch_size"]),
            inputs=tuple(TensorSpec(t["name"], t["datatype"], tuple(t["dims"])) for t in doc["inputs"]),
            outputs=tuple((o["name"], o["datatype"], tuple(o["dims"]), o["source"]) for o in doc["outputs"]),
            nodes=tuple(nodes), triton_model=doc.get("triton_model", ""), triton_models=tuple(doc.get("triton_models", ())),
            members=tuple(doc.get("members", ())), reasons=tuple(doc.get("reasons", ())),
        )  # fmt: skip

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def read_plan_files(repository: Path) -> list[Plan]:
    """Every plan in ``REPOSITORY/*.composite.json`` (what the compiler wrote)."""
    plans = []
    for path in sorted(Path(repository).glob(f"*{PLAN_SUFFIX}")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            plans.extend(Plan.from_json(p) for p in doc.get("versions", {}).values())
        except (ValueError, KeyError, TypeError) as err:
            log.error("composite plan file %s is unreadable: %s", path, err)
    return plans


def composite_signature(plans: Mapping[str, Plan]) -> ModelSignature:
    """The signature a composite serves under: its newest version's tensors, every version ready."""
    latest = plans[max(plans, key=version_key)]
    coalesce = CoalescePolicy(enabled=True, max_inflight=2, max_batch=latest.max_batch_size) if latest.mode == ENSEMBLE else CoalescePolicy(enabled=False)
    inputs = {t.name: t for t in latest.inputs}
    return ModelSignature(
        name=latest.name, max_batch_size=latest.max_batch_size, inputs=inputs,
        outputs={name: TensorSpec(name, dt, dims) for name, dt, dims, _ in latest.outputs},
        versions=frozenset(plans), backend=PLATFORM, required=frozenset(inputs), coalesce=coalesce,
        text_inputs=frozenset(t.name for t in latest.inputs if t.datatype == "BYTES"),
        params={"inferplane.composite": latest.mode},
    )  # fmt: skip


# ---- the composites a data plane serves --------------------------------------------------------


class Composites:
    """name -> {version: Plan}; the data plane keeps each composite's signature in its model table
    (``DataPlane.install_composite``: a composite resolves, lists and is validated like any model)
    and admits its requests; this runs them, through the model port and the LLM service."""

    def __init__(self, port: ModelPort, llm: LLMService, metrics):
        self.port = port
        self.llm = llm
        self.plans: dict[str, dict[str, Plan]] = {}
        registry = metrics.registry
        self.node_requests = Counter(
            "inferplane_composite_node_requests", "Node calls of composite endpoints run by the frontend, by composite, node and code.",
            ("composite", "node", "code"), registry=registry,
        )  # fmt: skip
        self.node_latency = Histogram(
            "inferplane_composite_node_duration_seconds", "Time a node of a composite took in the frontend's DAG executor.",
            ("composite", "node"), buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip

    def serves(self, name: str) -> bool:
        return name in self.plans

    def add(self, plan: Plan) -> ModelSignature:
        """The plan joins its composite's versions: the composite's signature now."""
        versions = self.plans.setdefault(plan.name, {})
        versions[plan.version] = plan
        return composite_signature(versions)

    def drop(self, name: str, version: str) -> ModelSignature | None:
        """The version leaves its composite: the composite's signature now (None: no version is left)."""
        versions = self.plans.get(name, {})
        versions.pop(version, None)
        if versions:
            return composite_signature(versions)
        self.plans.pop(name, None)
        return None

    def plan(self, name: str, version: str) -> Plan:
        versions = self.plans.get(name)
        if not versions:
            raise ModelNotFound(f"unknown model '{name}'")
        if not version:
            version = max(versions, key=version_key)
        plan = versions.get(version)
        if plan is None:
            raise ModelNotFound(f"unknown version '{version}' of composite '{name}' (versions: {sorted(versions, key=version_key)})")
        return plan

    # ---- metadata ---------------------------------------------------------------------------

    def describe(self, method: str, request) -> bytes:
        """ModelMetadata / ModelConfig of a composite, answered here (Triton knows its parts only)."""
        plan = self.plan(request.name, request.version)
        signature = self.port.signature(request.name)
        if method == "ModelMetadata":
            answer = pb.ModelMetadataResponse(name=plan.name, versions=sorted(signature.versions, key=version_key), platform=PLATFORM)
            for t in plan.inputs:
                answer.inputs.add(name=t.name, datatype=t.datatype, shape=[-1, *t.dims])
            for name, dt, dims, _ in plan.outputs:
                answer.outputs.add(name=name, datatype=dt, shape=[-1, *dims])
            return answer.SerializeToString()
        wire = {v: k for k, v in codecs.CONFIG_TO_WIRE.items()}
        config = model_config_pb2.ModelConfig(name=plan.name, platform=PLATFORM, max_batch_size=plan.max_batch_size)
        for t in plan.inputs:
            config.input.add(name=t.name, data_type=model_config_pb2.DataType.Value(wire[t.datatype]), dims=list(t.dims))
        for name, dt, dims, _ in plan.outputs:
            config.output.add(name=name, data_type=model_config_pb2.DataType.Value(wire[dt]), dims=list(dims))
        config.parameters["inferplane.composite"].string_value = plan.mode
        config.parameters["inferplane.composite_version"].string_value = plan.version
        response = pb.ModelConfigResponse()
        response.config.ParseFromString(config.SerializeToString())
        return response.SerializeToString()

    # ---- inference ----------------------------------------------------------------------------

    async def run(self, call, request: pb.ModelInferRequest, raw: bytes | None, ctx: CallContext | None) -> Answered:
        """The admitted ``call`` to a composite (``DataPlane.infer`` admitted it): its plan's answer."""
        name = request.model_name
        plan = self.plan(name, call.version)
        call.request = request
        try:
            if plan.mode == ENSEMBLE:
                answer = await self._ensemble(call, request, raw, plan)
            else:
                answer = await self._dag(call, request, plan, ctx)
        except InferplaneError:
            raise
        except Exception as err:  # a bug or a malformed answer: a status, never a crash
            log.exception("composite %s failed", name)
            raise BackendError(f"composite '{name}' failed: {type(err).__name__}: {err}") from None
        call.answer = answer
        return Answered(answer, call.version, call.arm)

    async def _ensemble(self, call, request: pb.ModelInferRequest, raw: bytes | None, plan: Plan) -> bytes:
        data = rename(raw if raw is not None else request.SerializeToString(), plan.triton_model)
        request.model_name, request.model_version = plan.triton_model, ""
        call.computed = True
        answer = await self.port.submit(call, request, data, call.signature)
        return rename(answer, plan.name, plan.version)  # the caller sees the composite's name and version

    async def _dag(self, call, request: pb.ModelInferRequest, plan: Plan, ctx: CallContext | None) -> bytes:
        tensors = _request_tensors(request)
        rows = next(iter(tensors.values())).shape[0]
        run = _Run(self, call, plan, ctx, tensors, rows)
        await run.execute()
        answer = pb.ModelInferResponse(model_name=plan.name, model_version=plan.version, id=request.id)
        wanted = [o.name for o in request.outputs] or [o[0] for o in plan.outputs]
        sources = {o[0]: o[3] for o in plan.outputs}
        for out in wanted:
            if out not in sources:
                raise InvalidRequest(f"composite '{plan.name}' has no output '{out}'", [Violation(f"outputs[{out!r}]", f"not one of {sorted(sources)}")])
            datatype, shape, data = codecs.from_numpy(run.tensors[sources[out]])
            answer.outputs.add(name=out, datatype=datatype, shape=shape)
            answer.raw_output_contents.append(data)
        return answer.SerializeToString()


class _NodeFailed(Exception):
    def __init__(self, node: str, error: InferplaneError):
        super().__init__(node)
        self.node, self.error = node, error


class _Run:
    """One request through a DAG plan."""

    def __init__(self, composites: Composites, call, plan: Plan, ctx: CallContext | None, tensors: dict, rows: int):
        self.c = composites
        self.call = call
        self.plan = plan
        self.ctx = ctx
        self.tensors: dict[str, np.ndarray] = dict(tensors)
        self.rows = rows
        self.failed: dict[str, InferplaneError] = {}
        self.started = time.perf_counter()
        self.timeout = call.timeout
        consumers: dict[str, list[NodePlan]] = {}
        for n in plan.nodes:
            for src in n.sources:
                consumers.setdefault(src, []).append(n)
            if n.kind == "router":
                for target in {*n.routes.values(), *([n.default] if n.default else [])}:
                    for src in plan.node(target).sources:
                        consumers.setdefault(src, []).append(n)
        self.consumers = consumers

    def _left(self) -> float | None:
        if self.timeout is None:
            return None
        left = self.timeout - (time.perf_counter() - self.started)
        if left <= 0:
            raise DeadlineExceeded(f"composite '{self.plan.name}' ran out of time")
        return left

    async def execute(self) -> None:
        pending = [n for n in self.plan.nodes if n.gated_by is None]
        done: set[str] = set()
        while pending:
            ready = [n for n in pending if all(s in done for s in self._needs(n))]
            if not ready:  # the compiler orders nodes; this cannot happen with a valid plan
                raise BackendError(f"composite '{self.plan.name}': nodes {[n.name for n in pending]} cannot run")
            results = await asyncio.gather(*(self._node(n) for n in ready), return_exceptions=True)
            for node, result in zip(ready, results):
                done.add(node.name)
                pending.remove(node)
                if isinstance(result, _NodeFailed):
                    self._failed(node, result.error)
                elif isinstance(result, BaseException):
                    raise result

    def _needs(self, node: NodePlan) -> set[str]:
        needs = set(node.sources)
        if node.kind == "router":
            for target in {*node.routes.values(), *([node.default] if node.default else [])}:
                needs |= set(self.plan.node(target).sources)
        return needs

    def _failed(self, node: NodePlan, error: InferplaneError) -> None:
        """A node failed: fine only while every node reading it is an aggregator that may ignore it."""
        readers = self.consumers.get(node.name, [])
        if readers and all(r.kind == "op" and r.on_failure == "ignore" for r in readers) and node.name not in self._output_nodes():
            self.failed[node.name] = error
            return
        raise _member_error(self.plan.name, node, error)

    def _output_nodes(self) -> set[str]:
        return {src.split(".", 1)[0] for _, _, _, src in self.plan.outputs}

    async def _node(self, node: NodePlan):
        started = time.perf_counter()
        code = "OK"
        span = None
        try:
            span = self._span(node)
            if node.kind == "router":
                await self._route(node)
            else:
                inputs = self._inputs(node)
                if inputs is None:
                    return None  # an aggregator left without its quorum raised inside _inputs
                outputs = await self._call(node, inputs, self.rows, span)
                for tensor, array in outputs.items():
                    self.tensors[f"{node.name}.{tensor}"] = array
            return None
        except _NodeFailed as failure:
            code = failure.error.reason
            return failure
        except InferplaneError as err:
            code = err.reason
            raise
        finally:
            self.c.node_requests.labels(self.plan.name, node.name, code).inc()
            self.c.node_latency.labels(self.plan.name, node.name).observe(time.perf_counter() - started)
            if span is not None:
                self._end_span(span, code)

    def _inputs(self, node: NodePlan) -> dict[str, np.ndarray]:
        out, missing = {}, []
        for name, ref in node.inputs.items():
            producer = ref.split(".", 1)[0] if "." in ref else ""
            if producer in self.failed:
                missing.append(producer)
                continue
            out[name] = self.tensors[ref]
        if missing:
            if len(out) < node.quorum:
                answered = [r.split(".", 1)[0] for r in node.inputs.values() if r.split(".", 1)[0] not in self.failed]
                first = self.failed[missing[0]]
                detail = "; ".join(f"{m}: {self.failed[m].reason}: {public_message(self.failed[m])}" for m in missing)
                raise _NodeFailed(node.name, type(_mapped(first))(
                    f"node '{node.name}' needs {node.quorum} of {len(node.inputs)} members; answered {answered}, failed: {detail}",
                    retry_after_s=first.retry_after_s,
                ))  # fmt: skip
        return out

    async def _call(self, node: NodePlan, inputs: dict[str, np.ndarray], rows: int, span) -> dict[str, np.ndarray]:
        ctx = self._child(span)
        try:
            if node.kind == "endpoint":
                return await self._endpoint(node, inputs, ctx)
            request = pb.ModelInferRequest(model_name=node.model, model_version=node.version)
            for name, array in inputs.items():
                datatype, shape, data = codecs.from_numpy(array)
                request.inputs.add(name=name, datatype=datatype, shape=shape)
                request.raw_input_contents.append(data)
            raw = (await self.c.port.infer(request, None, self._left(), ctx)).raw  # the one pipeline, per node
            return codecs.output_arrays(pb.ModelInferResponse.FromString(raw))
        except InferplaneError as err:
            raise _NodeFailed(node.name, err) from None

    async def _endpoint(self, node: NodePlan, inputs: dict[str, np.ndarray], ctx: CallContext) -> dict[str, np.ndarray]:
        llm = self.c.llm
        (array,) = inputs.values()
        texts = [_text(v) for v in array.reshape(-1)]
        if node.endpoint == "embeddings":
            vectors, _tokens = await llm.embed(node.model, texts, self._left(), ctx)
            return {"embedding": np.ascontiguousarray(vectors, dtype=np.float32)}

        def params(text: str) -> GenerateParams:
            p = GenerateParams(**{k: v for k, v in node.params.items() if k in ("max_tokens", "temperature", "top_p", "seed")})
            p.stop = list(node.params.get("stop") or [])
            if node.endpoint == "chat":
                p.messages = [{"role": "user", "content": text}]
            else:
                p.prompt = text
            return p

        chunks = await asyncio.gather(*(llm.complete(node.model, params(t), self._left(), self._child(None)) for t in texts))
        return {"text": np.array([c.text.encode("utf-8") for c in chunks], dtype=np.object_).reshape(-1, 1)}

    async def _route(self, node: NodePlan) -> None:
        keys = self.tensors[node.key]
        groups: dict[str, list[int]] = {}
        for row in range(keys.shape[0]):
            label = _label(keys[row].reshape(-1)[0]) if keys[row].size else ""
            target = node.routes.get(label, node.default)
            if target is None:
                raise InvalidRequest(
                    f"row {row}: router '{node.name}' has no branch for {label!r} (branches: {sorted(node.routes)})",
                    [Violation(f"row {row}", f"{node.key} = {label!r} matches no branch of '{node.name}'")],
                )
            groups.setdefault(target, []).append(row)
        outputs = {t: np.zeros((keys.shape[0], *dims), dtype=_dtype(dt)) for t, (dt, dims) in node.outputs.items()}

        async def branch(target: str, rows: list[int]) -> None:
            plan_node = self.plan.node(target)
            index = np.asarray(rows)
            inputs = {name: self.tensors[ref][index] for name, ref in plan_node.inputs.items()}
            span = self._span(plan_node)
            code = "OK"
            started = time.perf_counter()
            try:
                answer = await self._call(plan_node, inputs, len(rows), span)
            except _NodeFailed as failure:
                code = failure.error.reason
                raise _member_error(self.plan.name, plan_node, failure.error) from None
            finally:
                self.c.node_requests.labels(self.plan.name, target, code).inc()
                self.c.node_latency.labels(self.plan.name, target).observe(time.perf_counter() - started)
                if span is not None:
                    self._end_span(span, code)
            for t in outputs:
                outputs[t][index] = answer[t].reshape(len(rows), *outputs[t].shape[1:])

        await asyncio.gather(*(branch(t, r) for t, r in groups.items()))
        for t, array in outputs.items():
            self.tensors[f"{node.name}.{t}"] = array

    # ---- per node: context and span ------------------------------------------------------------

    def _child(self, span) -> CallContext:
        """A node's call context: the caller's identity (already authenticated), the composite's
        grant, its traffic class, and the node span as trace parent (a node has a span only on a
        traced call)."""
        if span is not None:
            context = span.get_span_context()
            headers = {"traceparent": format_traceparent(context.trace_id, context.span_id)}
        else:
            headers = {"traceparent": _UNSAMPLED}
        ctx = CallContext(timeout=None, headers=headers, delegation=Delegation(self.call.principal, self.plan.name))
        if self.ctx is not None:
            ctx.priority = self.ctx.priority
        return ctx

    def _span(self, node: NodePlan):
        trace = self.call.trace
        if trace is None:
            return None
        return trace.tracing.tracer.start_span(
            f"node {node.name}", context=trace.context,
            attributes={"inferplane.composite": self.plan.name, "inferplane.node": node.name, "inferplane.node.kind": node.kind,
                        "inferplane.node.model": node.model},
        )  # fmt: skip

    def _end_span(self, span, code: str) -> None:
        if code != "OK":
            from opentelemetry import trace

            span.set_status(trace.Status(trace.StatusCode.ERROR, code))
        span.set_attribute("inferplane.code", code)
        span.end()


# ---- helpers ------------------------------------------------------------------------------------


def _mapped(err: InferplaneError) -> InferplaneError:
    """A member that is not there is the composite's outage, not the caller's unknown model."""
    if isinstance(err, (ModelNotFound, ModelNotReady)):
        return BackendUnavailable(err.message, retry_after_s=err.retry_after_s or 1.0)
    return err


def _member_error(composite: str, node: NodePlan, err: InferplaneError) -> InferplaneError:
    mapped = _mapped(err)
    what = f"{node.kind} '{node.model}'" if node.model else node.kind
    out = type(mapped)(f"composite '{composite}': node '{node.name}' ({what}) failed: {public_message(err)}", list(err.violations), mapped.retry_after_s)
    return out


def _request_tensors(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    out = {}
    for i, t in enumerate(request.inputs):
        shape = [int(d) for d in t.shape]
        if i < len(request.raw_input_contents):
            out[t.name] = codecs.to_numpy(request.raw_input_contents[i], t.datatype, shape)
        else:
            values = getattr(t.contents, codecs.CONTENTS_FIELD[t.datatype])
            dtype = np.object_ if t.datatype == "BYTES" else codecs.numpy_dtype(t.datatype)
            out[t.name] = np.array(list(values), dtype=dtype).reshape(shape)
    return out


def _dtype(datatype: str):
    return np.object_ if datatype == "BYTES" else codecs.numpy_dtype(datatype)


def _label(value) -> str:
    """A router key's value as a branch label: integers without decimals, text decoded."""
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, (np.bool_, bool)):
        return "1" if value else "0"
    if isinstance(value, (np.integer, int)):
        return str(int(value))
    if isinstance(value, (np.floating, float)):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    return str(value)


def _text(value) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest("a text input is not valid UTF-8") from None
    return str(value)
