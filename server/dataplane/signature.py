"""A model version's declared signature, read from its Triton model config."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from batching.coalescer import CoalescePolicy
from server.dataplane.codecs import CONFIG_TO_WIRE, element_size
from server.errors import InvalidRequest
from server.protogen.inference import model_config_pb2


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # wire datatype, e.g. "FP32"
    dims: tuple[int, ...]  # without the batch dimension; -1 is variable
    optional: bool = False

    @property
    def element_size(self) -> int | None:
        return element_size(self.datatype)


@dataclass(frozen=True)
class ModelSignature:
    name: str
    max_batch_size: int  # 0: the model takes no batch dimension
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    versions: frozenset[str] = frozenset()
    backend: str = ""
    decoupled: bool = False
    required: frozenset[str] = field(default=frozenset())
    coalesce: CoalescePolicy = CoalescePolicy(enabled=False)
    instances: int = 1  # Triton instances serving it (all instance groups)
    max_running: int = 16  # an LLM engine's concurrent sequences (its ``max_running`` parameter)
    # BYTES inputs whose elements are UTF-8 text (validation checks them; other BYTES stay opaque):
    # the config parameter ``inferplane.text_inputs`` (comma-separated names), and every input of
    # a model speaking the LLM engine's contract
    text_inputs: frozenset[str] = frozenset()
    # the config's ``inferplane.*`` parameters (SLOs, payload logging, …), as strings
    params: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_config(cls, config: model_config_pb2.ModelConfig, versions=()) -> "ModelSignature":
        def spec(t, optional=False) -> TensorSpec:
            wire = CONFIG_TO_WIRE[model_config_pb2.DataType.Name(t.data_type)]
            return TensorSpec(t.name, wire, tuple(int(d) for d in t.dims), optional)

        inputs = {t.name: spec(t, t.optional) for t in config.input}
        params = {k: v.string_value for k, v in config.parameters.items()}
        instances = max(1, sum(max(1, g.count) for g in config.instance_group))
        outputs = {t.name: spec(t) for t in config.output}
        decoupled = config.model_transaction_policy.decoupled
        text = {n.strip() for n in params.get(TEXT_INPUTS_PARAMETER, "").split(",") if n.strip()}
        if decoupled and LLM_OUTPUTS <= set(outputs) and set(inputs) <= LLM_INPUTS:
            text |= set(inputs)
        return cls(
            name=config.name,
            max_batch_size=int(config.max_batch_size),
            inputs=inputs,
            outputs=outputs,
            versions=frozenset(str(v) for v in versions),
            backend=config.backend or config.platform,
            decoupled=decoupled,
            required=frozenset(name for name, s in inputs.items() if not s.optional),
            coalesce=CoalescePolicy.from_parameters(params, int(config.max_batch_size), instances),
            instances=instances,
            max_running=_int(params.get("max_running"), 16),
            text_inputs=frozenset(n for n in text if n in inputs and inputs[n].datatype == "BYTES"),
            params={k: v for k, v in params.items() if k.startswith("inferplane.")},
        )

    @cached_property  # read by every request that names no version; a signature never changes
    def latest_version(self) -> str:
        """The version Triton serves when a request names none (highest number)."""
        return max(self.versions, key=version_key) if self.versions else ""

    def expected_shape(self, tensor: TensorSpec) -> list[int]:
        """The full shape a request must carry, -1 where any size goes (batch included)."""
        return ([-1] if self.max_batch_size > 0 else []) + list(tensor.dims)


TEXT_INPUTS_PARAMETER = "inferplane.text_inputs"

# the LLM engine's contract (model_repository/adapters/llm_engine.py): BYTES in, text and info JSON out
LLM_INPUTS = frozenset({"text_input", "messages", "parameters"})
LLM_OUTPUTS = frozenset({"text_output", "info"})


def is_llm(signature: ModelSignature) -> bool:
    """A decoupled text-generation model speaking the LLM engine's inputs and outputs."""
    return signature.decoupled and LLM_OUTPUTS <= set(signature.outputs) and set(signature.inputs) <= LLM_INPUTS


def require_llm(name: str, signature: ModelSignature) -> None:
    """A generation's model is a text-generation model, or the request is invalid."""
    if not is_llm(signature):
        raise InvalidRequest(f"model '{name}' is not a text-generation model")


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        return default


def version_key(version: str):
    """Sort key for version strings: numbers numerically, anything else after them."""
    return (0, int(version), "") if version.isdigit() else (1, 0, version)
