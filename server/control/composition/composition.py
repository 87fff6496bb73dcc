"""Composite endpoints: the composition spec (YAML or JSON, validated with pydantic) and its types.

A composite is one endpoint made of registered model versions and small built-in operators::

    name: fraud_ensemble
    inputs:
      - {name: features, datatype: FP32, dims: [32]}
    nodes:
      - {name: xgb,  model: fraud_xgb,  inputs: {features: features}}   # member input -> tensor
      - {name: lgbm, model: fraud_lgbm, inputs: {features: features}}
      - {name: mean, op: average, inputs: [xgb.probability, lgbm.probability]}
      - {name: flag, op: threshold, inputs: [mean.output], params: {value: 0.5}}
    outputs: {probability: mean.output, is_fraud: flag.output}

A tensor is named ``INPUT`` (a composite input) or ``NODE.TENSOR`` (a node's output). Node kinds:

* ``model`` — a Triton model (``version`` pins one; unset: the live/latest one at registration),
  ``inputs`` maps each of its inputs to a tensor; its outputs are ``NODE.<output name>``.
* ``op`` — a built-in operator (``model_repository/adapters/_composite_ops.py``: concat, argmax,
  threshold, softmax, average, majority_vote, weighted_sum), ``inputs`` a list, ``params``; its
  output is ``NODE.output``. An aggregator (average, majority_vote, weighted_sum) may carry a
  quorum policy: ``on_failure: ignore`` + ``quorum: K`` answers from the K or more members that
  answered (``fail``, the default, fails the request with the first member that fails).
* ``router`` — ``key`` (a tensor: per row, its first element picks the branch), ``routes``
  (label -> node), ``default`` (a node, or none: a row without a branch is refused). Each row
  runs only its branch; the router's outputs are the tensors every branch produces, ``ROUTER.T``.
* ``endpoint`` — an LLM or embedding endpoint through the pipeline (token quotas and metering):
  ``endpoint: embeddings`` (input ``input``, BYTES text, output ``embedding``), ``completions``
  or ``chat`` (input ``prompt``, BYTES, output ``text``; ``params`` max_tokens, temperature,
  seed, stop).

Every model member must batch (``max_batch_size`` > 0): tensors are ``[rows, *dims]`` throughout,
the composite's ``max_batch_size`` is the smallest of its members'. :func:`type_check` infers
every tensor's type from the members' signatures and derives the composite's signature; the
compiler (``server.control.composition.composition_compiler``) decides where it runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
import yaml

from model_repository.adapters._composite_ops import AGGREGATORS, OPERATORS
from server.errors import InvalidRequest, Violation

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES")
INTEGER_TYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
FLOAT_TYPES = ("FP16", "FP32", "FP64")
ENDPOINT_KINDS = ("embeddings", "completions", "chat")
DEFAULT_MAX_BATCH = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorDecl(_Strict):
    name: str
    datatype: Literal[DATATYPES] = "FP32"  # type: ignore[valid-type]
    dims: list[int] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "TensorDecl":
        if not IDENTIFIER.match(self.name):
            raise ValueError(f"input name {self.name!r} must be an identifier (letters, digits, '_')")
        if any(d != -1 and d < 1 for d in self.dims):
            raise ValueError(f"dims {self.dims} must be positive or -1")
        return self


class ModelNode(_Strict):
    kind: ClassVar[str] = "model"
    name: str
    model: str
    version: int | None = Field(None, ge=1)
    inputs: dict[str, str] = Field(min_length=1)


class OpNode(_Strict):
    kind: ClassVar[str] = "op"
    name: str
    op: Literal[OPERATORS]  # type: ignore[valid-type]
    inputs: list[str] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    on_failure: Literal["fail", "ignore"] = "fail"
    quorum: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "OpNode":
        if self.on_failure == "ignore" and self.op not in AGGREGATORS:
            raise ValueError(f"on_failure: ignore needs an aggregating operator ({', '.join(AGGREGATORS)}), not {self.op}")
        if self.quorum is not None:
            if self.on_failure != "ignore":
                raise ValueError("quorum goes with on_failure: ignore")
            if self.quorum > len(self.inputs):
                raise ValueError(f"quorum {self.quorum} is more than the {len(self.inputs)} inputs")
        if self.op == "weighted_sum" and self.params.get("weights") is not None:
            weights = self.params["weights"]
            if not isinstance(weights, list) or len(weights) != len(self.inputs) or not all(isinstance(w, (int, float)) for w in weights):
                raise ValueError(f"weights must be {len(self.inputs)} numbers, one per input")
        if self.op == "threshold":
            if not isinstance(self.params.get("value", 0.5), (int, float)):
                raise ValueError("threshold value must be a number")
            if self.params.get("column") is not None and (not isinstance(self.params["column"], int) or self.params["column"] < 0):
                raise ValueError("threshold column must be an integer >= 0")
        unknown = set(self.params) - _OP_PARAMS.get(self.op, set())
        if unknown:
            raise ValueError(f"{self.op} takes no parameter {sorted(unknown)} (it takes {sorted(_OP_PARAMS.get(self.op, set())) or 'none'})")
        return self

    @property
    def quorum_needed(self) -> int:
        if self.on_failure != "ignore":
            return len(self.inputs)
        return self.quorum if self.quorum is not None else len(self.inputs) // 2 + 1


_OP_PARAMS = {"threshold": {"value", "column"}, "weighted_sum": {"weights", "normalize"}}


class RouterSpec(_Strict):
    key: str
    routes: dict[str, str] = Field(min_length=1)
    default: str | None = None


class RouterNode(_Strict):
    kind: ClassVar[str] = "router"
    name: str
    router: RouterSpec


class EndpointNode(_Strict):
    kind: ClassVar[str] = "endpoint"
    name: str
    endpoint: Literal[ENDPOINT_KINDS]  # type: ignore[valid-type]
    model: str
    inputs: dict[str, str] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "EndpointNode":
        expected = "input" if self.endpoint == "embeddings" else "prompt"
        if set(self.inputs) != {expected}:
            raise ValueError(f"a {self.endpoint} endpoint node takes one input, {expected!r}")
        allowed = set() if self.endpoint == "embeddings" else {"max_tokens", "temperature", "seed", "stop", "top_p"}
        unknown = set(self.params) - allowed
        if unknown:
            raise ValueError(f"a {self.endpoint} endpoint node takes no parameter {sorted(unknown)}")
        return self


def _node_kind(value: Any) -> str | None:
    if isinstance(value, Mapping):
        for kind in ("model", "op", "router", "endpoint"):
            if kind in value and (kind != "model" or "endpoint" not in value):
                return kind
        return None
    return getattr(value, "kind", None)


Node = Annotated[
    Union[
        Annotated[ModelNode, Tag("model")],
        Annotated[OpNode, Tag("op")],
        Annotated[RouterNode, Tag("router")],
        Annotated[EndpointNode, Tag("endpoint")],
    ],
    Discriminator(_node_kind, custom_error_type="node_kind", custom_error_message="a node needs one of model, op, router, endpoint"),
]


class CompositeSpec(_Strict):
    name: str
    description: str = ""
    inputs: list[TensorDecl] = Field(min_length=1)
    nodes: list[Node] = Field(min_length=1)
    outputs: dict[str, str] = Field(min_length=1)
    max_batch_size: int | None = Field(None, ge=1)

    def node(self, name: str):
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def canonical(self) -> bytes:
        """The spec as sorted JSON: what the registry stores (equal specs: equal bytes and digest)."""
        return json.dumps(self.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":")).encode()


# ---- parsing --------------------------------------------------------------------------------


def parse_spec(text: str | bytes | Mapping[str, Any], where: str = "spec") -> CompositeSpec:
    """A spec from YAML / JSON text or a mapping; every mistake an InvalidRequest naming its field."""
    if isinstance(text, (str, bytes)):

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise InvalidRequest(f"{where} is not valid YAML/JSON: {err}") from None
    else:
        doc = text
    if not isinstance(doc, Mapping):
        raise InvalidRequest(f"{where} must be a mapping with name, inputs, nodes and outputs")
    try:
        spec = CompositeSpec.model_validate(doc)
    except ValidationError as err:
        violations = [Violation(".".join(str(p) for p in e["loc"]) or where, e["msg"]) for e in err.errors()]
        first = violations[0]
        raise InvalidRequest(f"{where}: {first.field}: {first.description}", violations) from None
    check_graph(spec)
    return spec


def _bad(field_name: str, description: str) -> InvalidRequest:
    return InvalidRequest(f"composition: {field_name}: {description}", [Violation(field_name, description)])


@dataclass(frozen=True)
class Ref:
    """A tensor reference: a composite input (``node`` empty) or a node's output."""

    node: str
    tensor: str

    def __str__(self) -> str:
        return f"{self.node}.{self.tensor}" if self.node else self.tensor


def parse_ref(spec: CompositeSpec, text: str, where: str) -> Ref:
    if not isinstance(text, str) or not text:
        raise _bad(where, "must name a tensor: INPUT or NODE.TENSOR")
    node, dot, tensor = text.partition(".")
    if dot:
        if node not in {n.name for n in spec.nodes}:
            raise _bad(where, f"{text!r} names no node {node!r} (nodes: {', '.join(n.name for n in spec.nodes)})")
        if not tensor:
            raise _bad(where, f"{text!r} names no tensor of node {node!r}")
        return Ref(node, tensor)
    if text not in {t.name for t in spec.inputs}:
        raise _bad(where, f"{text!r} is not a composite input (inputs: {', '.join(t.name for t in spec.inputs)}); a node's tensor is NODE.TENSOR")
    return Ref("", text)


def node_refs(spec: CompositeSpec, node) -> list[tuple[str, Ref]]:
    """(where, ref) of every tensor a node reads (a router: its key)."""
    i = next(k for k, n in enumerate(spec.nodes) if n.name == node.name)
    if node.kind in ("model", "endpoint"):
        return [(f"nodes.{i}.inputs.{k}", parse_ref(spec, v, f"nodes.{i}.inputs.{k}")) for k, v in node.inputs.items()]
    if node.kind == "op":
        return [(f"nodes.{i}.inputs.{k}", parse_ref(spec, v, f"nodes.{i}.inputs.{k}")) for k, v in enumerate(node.inputs)]
    return [(f"nodes.{i}.router.key", parse_ref(spec, node.router.key, f"nodes.{i}.router.key"))]


def route_targets(spec: CompositeSpec) -> dict[str, str]:
    """node -> the router that gates it (a branch runs only for the rows routed to it)."""
    gated = {}
    for n in spec.nodes:
        if n.kind == "router":
            for target in {*n.router.routes.values(), *([n.router.default] if n.router.default else [])}:
                gated[target] = n.name
    return gated


def dependencies(spec: CompositeSpec, node) -> set[str]:
    """The nodes ``node`` needs before it runs (a router: its key and its branches' inputs)."""
    deps = {ref.node for _, ref in node_refs(spec, node) if ref.node}
    if node.kind == "router":
        for target in {*node.router.routes.values(), *([node.router.default] if node.router.default else [])}:
            deps |= {ref.node for _, ref in node_refs(spec, spec.node(target)) if ref.node}
    return deps


def check_graph(spec: CompositeSpec) -> list[str]:
    """Names, references, routes, no cycles, every node used; returns the nodes in run order."""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,100}$", spec.name) or "__" in spec.name:
        raise _bad("name", f"{spec.name!r}: letters, digits, '_' and '-' (no '__'), up to 101 characters")
    names = [n.name for n in spec.nodes]
    inputs = {t.name for t in spec.inputs}
    for i, n in enumerate(spec.nodes):
        if not IDENTIFIER.match(n.name):
            raise _bad(f"nodes.{i}.name", f"{n.name!r} must be an identifier (letters, digits, '_')")
        if n.name in inputs:
            raise _bad(f"nodes.{i}.name", f"{n.name!r} is also a composite input")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise _bad("nodes", f"node names must be unique: {dupes}")
    if len(inputs) != len(spec.inputs):
        raise _bad("inputs", "input names must be unique")
    for name in spec.outputs:
        if not IDENTIFIER.match(name) or "__" in name:
            raise _bad(f"outputs.{name}", "an output name must be an identifier without '__'")
        if name in inputs:
            raise _bad(f"outputs.{name}", f"{name!r} is also an input name")
    gated = route_targets(spec)
    for i, n in enumerate(spec.nodes):
        if n.kind != "router":
            continue
        for label, target in {**n.router.routes, **({"default": n.router.default} if n.router.default else {})}.items():
            if target not in names:
                raise _bad(f"nodes.{i}.router.routes.{label}", f"{target!r} is not a node")
            kind = spec.node(target).kind
            if kind == "router":
                raise _bad(f"nodes.{i}.router.routes.{label}", f"{target!r} is a router; a branch is a model, op or endpoint node")
            if gated.get(target) != n.name:
                raise _bad(f"nodes.{i}.router.routes.{label}", f"{target!r} is a branch of two routers")
    order = topological_order(spec)
    used: set[str] = set()
    for n in spec.nodes:
        for where, ref in node_refs(spec, n):
            if ref.node:
                if ref.node in gated and gated[ref.node] != n.name:
                    raise _bad(where, f"{ref} is a branch of router {gated[ref.node]!r}: read it as {gated[ref.node]}.{ref.tensor}")
                used.add(ref.node)
    output_refs = []
    for name, text in spec.outputs.items():
        ref = parse_ref(spec, text, f"outputs.{name}")
        if not ref.node:
            raise _bad(f"outputs.{name}", f"{text!r} is a composite input; an output comes from a node")
        if ref.node in gated:
            raise _bad(f"outputs.{name}", f"{ref} is a branch of router {gated[ref.node]!r}: read it as {gated[ref.node]}.{ref.tensor}")
        if str(ref) in output_refs:
            raise _bad(f"outputs.{name}", f"{ref} is already the output {next(k for k, v in spec.outputs.items() if v == text)!r}")
        output_refs.append(str(ref))
        used.add(ref.node)
    unused = [n for n in names if n not in used and n not in gated]
    if unused:
        raise _bad("nodes", f"nothing reads the outputs of {unused}: every node must feed an output")
    read_inputs = {ref.tensor for n in spec.nodes for _, ref in node_refs(spec, n) if not ref.node}
    for t in spec.inputs:
        if t.name not in read_inputs:
            raise _bad("inputs", f"no node reads the input {t.name!r}")
    return order


def topological_order(spec: CompositeSpec) -> list[str]:
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise _bad("nodes", f"cycle: {' -> '.join([*path, name])}")
        state[name] = 1
        for dep in sorted(dependencies(spec, spec.node(name)) - {name}):
            visit(dep, [*path, name])
        if name in dependencies(spec, spec.node(name)):
            raise _bad("nodes", f"cycle: {name} reads its own output")
        state[name] = 2
        order.append(name)

    for n in spec.nodes:
        visit(n.name, [])
    return order


# ---- types ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorType:
    datatype: str
    dims: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.datatype}{list(self.dims)}"


@dataclass(frozen=True)
class Member:
    """What a composition needs to know of a model: its tensors, batching and kind."""

    name: str
    version: int | None  # the version a node pins (None: whatever Triton serves as latest)
    inputs: Mapping[str, TensorType]
    outputs: Mapping[str, TensorType]
    max_batch_size: int
    optional_inputs: frozenset[str] = frozenset()
    decoupled: bool = False
    kind: str = "model"  # model | embedding | llm

    @classmethod
    def from_signature(cls, name: str, version: int | None, signature: Mapping[str, Any], max_batch_size: int | None = None, **kw) -> "Member":
        """From a registry signature (``{"inputs": [{"name","datatype","dims"}], "outputs": [...]}``)."""

        def side(key):
            return {t["name"]: TensorType(str(t.get("datatype", "FP32")).upper(), tuple(int(d) for d in t["dims"])) for t in signature[key]}

        mbs = max_batch_size if max_batch_size is not None else int(signature.get("max_batch_size", DEFAULT_MAX_BATCH))
        return cls(name, version, side("inputs"), side("outputs"), mbs, **kw)


Lookup = Callable[[str, "int | None"], Member]  # (model name, pinned version) -> Member; raises ModelNotFound


@dataclass
class Typed:
    """A type-checked composition: each node's member, each tensor's type, the derived signature."""

    spec: CompositeSpec
    order: list[str]
    members: dict[str, Member]  # node -> its model (model and endpoint nodes)
    tensors: dict[str, TensorType]  # "INPUT" / "NODE.TENSOR" -> type
    node_outputs: dict[str, dict[str, TensorType]]
    max_batch_size: int
    gated: dict[str, str] = field(default_factory=dict)

    def signature(self) -> dict[str, Any]:
        """The composite's signature, in the registry's form."""
        return {
            "inputs": [{"name": t.name, "datatype": t.datatype, "dims": list(t.dims)} for t in self.spec.inputs],
            "outputs": [
                {"name": name, "datatype": self.tensors[ref].datatype, "dims": list(self.tensors[ref].dims)}
                for name, ref in self.spec.outputs.items()
            ],
            "max_batch_size": self.max_batch_size,
        }


def _compatible(declared: TensorType, wanted: TensorType) -> bool:
    if declared.datatype != wanted.datatype or len(declared.dims) != len(wanted.dims):
        return False
    return all(w == -1 or d == w for d, w in zip(declared.dims, wanted.dims))


def type_check(spec: CompositeSpec, lookup: Lookup) -> Typed:
    """Every tensor's type from the members' signatures; refuses mismatches naming the node."""
    order = check_graph(spec)
    gated = route_targets(spec)
    tensors = {t.name: TensorType(t.datatype, tuple(t.dims)) for t in spec.inputs}
    node_outputs: dict[str, dict[str, TensorType]] = {}
    members: dict[str, Member] = {}
    limits = [spec.max_batch_size] if spec.max_batch_size else []
    index = {n.name: i for i, n in enumerate(spec.nodes)}

    def typed_refs(node) -> list[tuple[str, str, TensorType]]:
        out = []
        for where, ref in node_refs(spec, node):
            key = str(ref)
            if key not in tensors:
                producer = ref.node
                known = sorted(node_outputs.get(producer, {}))
                raise _bad(where, f"node {producer!r} has no output {ref.tensor!r} (outputs: {known})")
            out.append((where, key, tensors[key]))
        return out

    for name in order:
        node = spec.node(name)
        i = index[name]
        if node.kind == "model":
            member = lookup(node.model, node.version)
            members[name] = member
            if member.max_batch_size <= 0:
                raise _bad(f"nodes.{i}.model", f"model {node.model!r} does not batch (max_batch_size 0); composites need batching members")
            if member.decoupled:
                raise _bad(f"nodes.{i}.model", f"model {node.model!r} streams (decoupled): use an endpoint node (completions / chat)")
            limits.append(member.max_batch_size)
            for where, key, got in typed_refs(node):
                tensor = where.rsplit(".", 1)[1]
                if tensor not in member.inputs:
                    raise _bad(where, f"model {node.model!r} has no input {tensor!r} (inputs: {sorted(member.inputs)})")
                if not _compatible(got, member.inputs[tensor]):
                    raise _bad(where, f"{key} is {got.describe()}; {node.model!r} input {tensor!r} takes {member.inputs[tensor].describe()}")
            missing = sorted(set(member.inputs) - set(node.inputs) - set(member.optional_inputs))
            if missing:
                raise _bad(f"nodes.{i}.inputs", f"model {node.model!r} needs inputs {missing}")
            outs = dict(member.outputs)
        elif node.kind == "endpoint":
            member = lookup(node.model, None)
            members[name] = member
            (where, key, got), = typed_refs(node)
            if got.datatype != "BYTES" or got.dims != (1,):
                raise _bad(where, f"{key} is {got.describe()}; an endpoint node reads text, BYTES[1]")
            if node.endpoint == "embeddings":
                if member.kind != "embedding" or "embedding" not in member.outputs:
                    raise _bad(f"nodes.{i}.model", f"{node.model!r} is not an embedding model")
                outs = {"embedding": TensorType("FP32", member.outputs["embedding"].dims)}
            else:
                if member.kind != "llm":
                    raise _bad(f"nodes.{i}.model", f"{node.model!r} is not a text-generation model")
                outs = {"text": TensorType("BYTES", (1,))}
        elif node.kind == "op":
            outs = {"output": _op_type(node, [(w, k, t) for w, k, t in typed_refs(node)], i)}
        else:
            (where, key, got), = typed_refs(node)
            branches = sorted({*node.router.routes.values(), *([node.router.default] if node.router.default else [])})
            common = None
            for b in branches:
                produced = node_outputs[b]
                common = dict(produced) if common is None else {k: v for k, v in common.items() if produced.get(k) == v}
            if not common:
                raise _bad(f"nodes.{i}.router", f"the branches {branches} produce no tensor in common (same name, type and dims)")
            outs = common
        node_outputs[name] = outs
        for tensor, t in outs.items():
            tensors[f"{name}.{tensor}"] = t
    for name, text in spec.outputs.items():
        if text not in tensors:
            ref = parse_ref(spec, text, f"outputs.{name}")
            raise _bad(f"outputs.{name}", f"node {ref.node!r} has no output {ref.tensor!r} (outputs: {sorted(node_outputs.get(ref.node, {}))})")
    max_batch = min(limits) if limits else DEFAULT_MAX_BATCH
    return Typed(spec, order, members, tensors, node_outputs, max_batch, gated)


def _op_type(node: OpNode, refs: list[tuple[str, str, TensorType]], i: int) -> TensorType:
    where0, key0, first = refs[0]
    op = node.op
    if op in ("argmax", "threshold", "softmax") and len(refs) != 1:
        raise _bad(f"nodes.{i}.inputs", f"{op} takes one input, got {len(refs)}")
    if op == "concat":
        if any(t.datatype != first.datatype for _, _, t in refs):
            raise _bad(f"nodes.{i}.inputs", f"concat inputs must share one datatype: {[t.describe() for _, _, t in refs]}")
        if any(len(t.dims) != 1 or t.dims[0] == -1 for _, _, t in refs):
            raise _bad(f"nodes.{i}.inputs", f"concat takes fixed one-dimensional rows: {[t.describe() for _, _, t in refs]}")
        return TensorType(first.datatype, (sum(t.dims[0] for _, _, t in refs),))
    if op in ("average", "weighted_sum", "majority_vote"):
        if any(t.dims != first.dims for _, _, t in refs):
            raise _bad(f"nodes.{i}.inputs", f"{op} inputs must share one shape: {[f'{k} {t.describe()}' for _, k, t in refs]}")
        numeric = INTEGER_TYPES if op == "majority_vote" else (*INTEGER_TYPES, *FLOAT_TYPES)
        bad = [f"{k} {t.describe()}" for _, k, t in refs if t.datatype not in numeric]
        if bad:
            raise _bad(f"nodes.{i}.inputs", f"{op} needs {'integer labels' if op == 'majority_vote' else 'numbers'}, got {bad}")
        return TensorType("INT32" if op == "majority_vote" else "FP32", first.dims)
    if first.datatype == "BYTES":
        raise _bad(where0, f"{op} needs numbers, {key0} is BYTES")
    if op == "argmax":
        return TensorType("INT32", (1,))
    if op == "softmax":
        if first.datatype not in FLOAT_TYPES:
            raise _bad(where0, f"softmax needs floating point, {key0} is {first.datatype}")
        return TensorType("FP32", first.dims)
    column = node.params.get("column")
    if column is not None:
        if len(first.dims) != 1 or (first.dims[0] != -1 and column >= first.dims[0]):
            raise _bad(f"nodes.{i}.params.column", f"column {column} is not in {key0} {first.describe()}")
        return TensorType("INT32", (1,))
    return TensorType("INT32", first.dims)
