"""Compile a type-checked composition into what serves it: a Triton ensemble, or a plan for the
frontend's DAG executor (``server.dataplane.composite``), plus one Python-backend model per
built-in operator.

Where it runs is decided per composite, with a reason per node (``inferplane compose explain``):

* **Triton ensemble** when every node runs in Triton (members and operators): one
  ``ensemble_scheduling`` config, the frontend makes one call, Triton moves the tensors between
  steps — no hop back to the frontend between nodes.
* **The frontend's DAG executor** as soon as one node cannot be an ensemble step: a **router**
  (each row goes only to its branch; an ensemble runs every step for every request), an
  **LLM/embedding endpoint** node (generation and embeddings go through the pipeline for their
  token quotas and metering), or an aggregator with a **quorum policy** (``on_failure: ignore``;
  an ensemble fails the request when any step fails). Each node is then one ``DataPlane.infer``
  (or LLM service) call through the pipeline: auth, quotas, metering and metrics per node.

Names in Triton: composite ``NAME`` version ``V`` is the ensemble ``NAME__vV``, its operator
``NODE`` the model ``NAME__vV__NODE`` (version 1). The plan of every compiled version is kept
in ``REPOSITORY/NAME.composite.json`` (a file, which Triton's repository ignores); the frontend
installs the plans it finds there at start.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from model_repository.adapters._composite_ops import OUTPUT, input_name
from model_repository.config_writer import EnsembleStep, ModelConfig, ensemble_config, operator_config, read_config, to_text, write_config
from model_repository.layout import install_adapter
from server.control.composition.composition import CompositeSpec, Lookup, Member, TensorType, Typed, node_refs, type_check
from server.dataplane import codecs
from server.protogen.inference import model_config_pb2
from server.control.composition.composition import Ref
from server.errors import ModelNotFound

ENSEMBLE, DAG = "ensemble", "dag"
PLAN_SUFFIX = ".composite.json"
PLAN_FORMAT = 1
OPERATOR_ADAPTER = "composite_operator.py"
OPERATOR_HELPERS = ("_composite_ops.py",)
COMPOSITE_PARAMETER = "inferplane.composite"  # on every Triton model a composite owns: "NAME:VERSION"

_WHY_ENSEMBLE = "every node runs in Triton: one Triton ensemble, one call from the frontend, no hop back between nodes"
_WHY_ROUTER = "a routing decision: each row runs only its branch (a Triton ensemble runs every step for every request)"
_WHY_ENDPOINT = "an LLM/embedding endpoint: called through the pipeline, whose token quotas and metering apply to it"
_WHY_QUORUM = "a quorum fan-out: answers when {k} of {n} members answer (a Triton ensemble fails the request when one step fails)"


def triton_name(composite: str, version: int) -> str:
    return f"{composite}__v{version}"


def operator_name(composite: str, version: int, node: str) -> str:
    return f"{composite}__v{version}__{node}"


_INTERNAL = re.compile(r"__v[0-9]+(__|$)")


def is_internal(name: str) -> bool:
    """A Triton model a composite compiled to (its ensemble or an operator), not an endpoint of its own."""
    return _INTERNAL.search(name) is not None


def plan_path(repository: Path, name: str) -> Path:
    return Path(repository) / f"{name}{PLAN_SUFFIX}"


@dataclass(frozen=True)
class Placement:
    node: str
    kind: str  # model | op | router | endpoint
    target: str  # the Triton model (or endpoint model) it calls; '' for a router
    runs: str  # "triton ensemble step" | "frontend DAG" | "frontend"
    why: str


@dataclass
class Compiled:
    name: str
    version: int
    mode: str  # ensemble | dag
    reasons: list[str]  # why this mode (the DAG: each node that needs it)
    placements: list[Placement]
    signature: dict[str, Any]  # derived: inputs, outputs, max_batch_size
    members: list[dict[str, Any]]  # {"node", "model", "version"} of each model / endpoint node
    configs: dict[str, ModelConfig] = field(default_factory=dict)  # Triton models to write: operators (+ the ensemble)
    plan: dict[str, Any] = field(default_factory=dict)

    @property
    def triton_models(self) -> list[str]:
        """Operators first, the ensemble last (load order)."""
        return sorted(self.configs, key=lambda n: (self.configs[n].platform == "ensemble", n))

    def explain(self) -> dict[str, Any]:
        return {
            "name": self.name, "version": self.version, "mode": self.mode, "reasons": self.reasons,
            "signature": self.signature, "members": self.members,
            "nodes": [asdict(p) for p in self.placements], "triton_models": self.triton_models,
        }  # fmt: skip


def _config_type(datatype: str) -> int:
    wire = {v: k for k, v in codecs.CONFIG_TO_WIRE.items()}
    return model_config_pb2.DataType.Value(wire[datatype])


def decide(typed: Typed) -> tuple[str, list[str], dict[str, str]]:
    """(mode, reasons, node -> why it needs the frontend) of a type-checked composition."""
    needs: dict[str, str] = {}
    for name in typed.order:
        node = typed.spec.node(name)
        if node.kind == "router":
            needs[name] = _WHY_ROUTER
        elif node.kind == "endpoint":
            needs[name] = _WHY_ENDPOINT
        elif node.kind == "op" and node.on_failure == "ignore":
            needs[name] = _WHY_QUORUM.format(k=node.quorum_needed, n=len(node.inputs))
    if not needs:
        return ENSEMBLE, [_WHY_ENSEMBLE], needs
    return DAG, [f"node {n!r}: {why}" for n, why in needs.items()], needs


def compile_spec(spec: CompositeSpec, version: int, lookup: Lookup) -> Compiled:
    typed = type_check(spec, lookup)
    mode, reasons, needs = decide(typed)
    name = spec.name
    placements, members, configs, plan_nodes = [], [], {}, []
    for node_name in typed.order:
        node = spec.node(node_name)
        outs = {t: {"datatype": v.datatype, "dims": list(v.dims)} for t, v in typed.node_outputs[node_name].items()}
        entry: dict[str, Any] = {"name": node_name, "kind": node.kind, "outputs": outs, "gated_by": typed.gated.get(node_name)}
        if node.kind == "model":
            member = typed.members[node_name]
            entry.update(model=member.name, version=str(member.version) if member.version else "", inputs=dict(node.inputs))
            members.append({"node": node_name, "model": member.name, "version": member.version})
            target = member.name + (f":{member.version}" if member.version else "")
        elif node.kind == "endpoint":
            member = typed.members[node_name]
            entry.update(endpoint=node.endpoint, model=member.name, inputs=dict(node.inputs), params=dict(node.params))
            members.append({"node": node_name, "model": member.name, "version": member.version})
            target = f"{node.endpoint}:{member.name}"
        elif node.kind == "op":
            op_model = operator_name(name, version, node_name)
            entry.update(
                model=op_model, version="1", op=node.op, params=dict(node.params), on_failure=node.on_failure,
                quorum=node.quorum_needed, inputs={input_name(i): ref for i, ref in enumerate(node.inputs)},
            )  # fmt: skip
            configs[op_model] = _operator_config(typed, node, op_model, name, version)
            target = op_model
        else:
            entry.update(key=node.router.key, routes=dict(node.router.routes), default=node.router.default)
            target = ""
        plan_nodes.append(entry)
        if mode == ENSEMBLE:
            placements.append(Placement(node_name, node.kind, target, "triton ensemble step", _WHY_ENSEMBLE))
        elif node_name in needs:
            placements.append(Placement(node_name, node.kind, target, "frontend", needs[node_name]))
        else:
            placements.append(Placement(
                node_name, node.kind, target, "frontend DAG",
                "one DataPlane.infer call through the pipeline (the composite runs in the frontend: " + "; ".join(reasons) + ")",
            ))  # fmt: skip
    signature = typed.signature()
    plan: dict[str, Any] = {
        "format": PLAN_FORMAT, "name": name, "version": version, "mode": mode,
        "max_batch_size": typed.max_batch_size, "inputs": signature["inputs"],
        "outputs": [{**o, "source": spec.outputs[o["name"]]} for o in signature["outputs"]],
        "nodes": plan_nodes, "reasons": reasons, "members": members,
    }  # fmt: skip
    if mode == ENSEMBLE:
        ensemble = _ensemble_config(typed, name, version)
        configs[ensemble.name] = ensemble
        plan["triton_model"] = ensemble.name
    plan["triton_models"] = sorted(configs)
    return Compiled(name, version, mode, reasons, placements, signature, members, configs, plan)


def _operator_config(typed: Typed, node, model_name: str, composite: str, version: int) -> ModelConfig:
    spec = typed.spec
    optional = node.on_failure == "ignore"
    inputs = []
    for i, (_, ref) in enumerate(node_refs(spec, node)):
        t = typed.tensors[str(ref)]
        inputs.append((input_name(i), _config_type(t.datatype), t.dims, optional))
    out = typed.node_outputs[node.name][OUTPUT]
    parameters = {
        "op": node.op, "params": json.dumps(node.params, sort_keys=True),
        COMPOSITE_PARAMETER: f"{composite}:{version}",
    }  # fmt: skip
    return operator_config(model_name, typed.max_batch_size, inputs, (OUTPUT, _config_type(out.datatype), out.dims), parameters)


def _ensemble_config(typed: Typed, name: str, version: int) -> ModelConfig:
    spec = typed.spec
    outputs_of = {ref: out for out, ref in spec.outputs.items()}

    def tensor(ref) -> str:
        key = str(ref)
        if not ref.node:
            return key
        return outputs_of.get(key, f"{ref.node}__{ref.tensor}")

    read = {str(ref) for n in spec.nodes for _, ref in node_refs(spec, n)} | set(spec.outputs.values())
    steps = []
    for node_name in typed.order:
        node = spec.node(node_name)
        refs = node_refs(spec, node)
        if node.kind == "model":
            member = typed.members[node_name]
            input_map = {where.rsplit(".", 1)[1]: tensor(ref) for where, ref in refs}
            output_map = {t: tensor(_ref(node_name, t)) for t in member.outputs if f"{node_name}.{t}" in read}
            steps.append(EnsembleStep(member.name, member.version or -1, input_map, output_map))
        else:  # an operator (routers and endpoints never compile to an ensemble)
            input_map = {input_name(i): tensor(ref) for i, (_, ref) in enumerate(refs)}
            steps.append(EnsembleStep(operator_name(name, version, node_name), 1, input_map, {OUTPUT: tensor(_ref(node_name, OUTPUT))}))
    inputs = [(t.name, _config_type(t.datatype), t.dims) for t in spec.inputs]
    outputs = [(out, _config_type(typed.tensors[ref].datatype), typed.tensors[ref].dims) for out, ref in spec.outputs.items()]
    parameters = {
        COMPOSITE_PARAMETER: f"{name}:{version}", "inferplane.coalesce": "true",
        "inferplane.coalesce_max_inflight": "2",
    }  # fmt: skip
    return ensemble_config(triton_name(name, version), typed.max_batch_size, inputs, outputs, steps, parameters)


def _ref(node: str, tensor: str):
    return Ref(node, tensor)


# ---- the repository -------------------------------------------------------------------------


def write_compiled(compiled: Compiled, repository: Path) -> list[str]:
    """Write the operator models, the ensemble (if any) and the plan into the Triton repository;
    returns the Triton model names written (load them in this order)."""
    repository = Path(repository)
    for model_name in compiled.triton_models:
        config = compiled.configs[model_name]
        model_dir = repository / model_name
        staging = repository / f".staging-{model_name}-{uuid.uuid4().hex[:8]}"
        version_dir = staging / "1"
        version_dir.mkdir(parents=True)
        if config.platform != "ensemble":
            install_adapter(version_dir, OPERATOR_ADAPTER, *OPERATOR_HELPERS)
        write_config(config, staging)
        if model_dir.exists():
            if (model_dir / "config.pbtxt").is_file() and to_text(read_config(model_dir)) == to_text(config):
                shutil.rmtree(staging)
                continue  # the same model is there (and may be serving): leave it
            shutil.rmtree(model_dir)
        staging.rename(model_dir)
    add_plan(repository, compiled.plan)
    return compiled.triton_models


def read_plans(repository: Path, name: str) -> dict[str, dict]:
    path = plan_path(repository, name)
    if not path.is_file():
        return {}
    return dict(json.loads(path.read_text(encoding="utf-8")).get("versions", {}))


def add_plan(repository: Path, plan: dict) -> None:
    versions = read_plans(repository, plan["name"])
    versions[str(plan["version"])] = plan
    _write_plans(repository, plan["name"], versions)


def remove_plan(repository: Path, name: str, version: int) -> dict:
    """Drop one version's plan; returns it (the Triton models it owned are the caller's to unload)."""
    versions = read_plans(repository, name)
    plan = versions.pop(str(version), None)
    if versions:
        _write_plans(repository, name, versions)
    else:
        plan_path(repository, name).unlink(missing_ok=True)
    return plan or {}


def _write_plans(repository: Path, name: str, versions: dict) -> None:
    path = plan_path(repository, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    doc = {"name": name, "versions": {k: versions[k] for k in sorted(versions, key=int)}}
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---- members from what is at hand -----------------------------------------------------------


def member_from_config(config: ModelConfig, version: int | None) -> Member:
    """A member from a Triton model config (a repository folder, or the data plane's model table)."""

    def t(tensor) -> TensorType:
        return TensorType(codecs.CONFIG_TO_WIRE[model_config_pb2.DataType.Name(tensor.data_type)], tuple(int(d) for d in tensor.dims))

    inputs = {x.name: t(x) for x in config.input}
    outputs = {x.name: t(x) for x in config.output}
    return Member(
        config.name, version, inputs, outputs, int(config.max_batch_size),
        optional_inputs=frozenset(x.name for x in config.input if x.optional),
        decoupled=config.model_transaction_policy.decoupled, kind=member_kind(inputs, outputs, config.model_transaction_policy.decoupled),
    )  # fmt: skip


def member_kind(inputs, outputs, decoupled: bool) -> str:
    if decoupled and {"text_output", "info"} <= set(outputs):
        return "llm"
    if "text" in inputs and "embedding" in outputs:
        return "embedding"
    return "model"


def repository_lookup(repository: Path) -> Lookup:
    """Members read from the models' ``config.pbtxt`` in a repository; an unpinned node pins the
    highest version folder there."""
    def lookup(name: str, version: int | None) -> Member:
        model_dir = Path(repository) / name
        if not (model_dir / "config.pbtxt").is_file():
            raise ModelNotFound(f"no model '{name}' in the repository {repository}")
        versions = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
        if version is not None and version not in versions:
            raise ModelNotFound(f"no version {version} of model '{name}' in the repository (versions: {versions})")
        return member_from_config(read_config(model_dir), version or (versions[-1] if versions else None))

    return lookup
