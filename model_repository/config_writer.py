"""Triton ``config.pbtxt``: built from the model-config protobuf and ``text_format``, never templated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from google.protobuf import text_format

from server.protogen.inference import model_config_pb2

ModelConfig = model_config_pb2.ModelConfig
CONFIG_FILE = "config.pbtxt"


@dataclass(frozen=True)
class ServingConfig:
    """How Triton serves one model: batch limits, batching window, instances, response cache; how
    many threads its adapter's framework uses; and how the frontend merges requests for it
    (``inferplane.coalesce*`` parameters, read by ``batching.coalescer.CoalescePolicy``)."""

    max_batch_size: int = 64
    preferred_batch_sizes: tuple[int, ...] = (16, 32, 64)
    max_queue_delay_us: int = 200
    instances: int = 1
    response_cache: bool = False
    threads: int = 1  # the adapter's intra-op threads (ONNX Runtime, XGBoost, LightGBM)
    coalesce: bool = True  # the frontend merges concurrent requests into one Triton call
    coalesce_max_inflight: int | None = None  # merged calls at once (None: one per instance)
    coalesce_window_us: int = 0  # > 0: the longest a request waits for a free call slot

    def __post_init__(self) -> None:
        if self.max_batch_size < 0 or self.instances < 1 or self.max_queue_delay_us < 0 or self.threads < 1:
            raise ValueError(f"invalid serving config: {self}")
        if self.coalesce_window_us < 0 or (self.coalesce_max_inflight is not None and self.coalesce_max_inflight < 1):
            raise ValueError(f"invalid coalescing settings: {self}")
        too_big = [b for b in self.preferred_batch_sizes if b < 1 or b > max(self.max_batch_size, 1)]
        if too_big:
            raise ValueError(f"preferred batch sizes {too_big} outside 1..{self.max_batch_size}")

    def apply(self, config: ModelConfig) -> ModelConfig:
        """Set the serving fields of ``config`` (in place) and return it."""
        config.max_batch_size = self.max_batch_size
        del config.instance_group[:]
        config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=self.instances)
        config.ClearField("dynamic_batching")
        if self.max_batch_size > 0:
            batching = config.dynamic_batching
            batching.preferred_batch_size.extend(sorted(set(self.preferred_batch_sizes)))
            batching.max_queue_delay_microseconds = self.max_queue_delay_us
        config.ClearField("response_cache")
        if self.response_cache:
            config.response_cache.enable = True
        config.parameters["threads"].string_value = str(self.threads)
        config.parameters["inferplane.coalesce"].string_value = "true" if self.coalesce else "false"
        config.parameters["inferplane.coalesce_window_us"].string_value = str(self.coalesce_window_us)
        if self.coalesce_max_inflight is not None:
            config.parameters["inferplane.coalesce_max_inflight"].string_value = str(self.coalesce_max_inflight)
        else:
            config.parameters.pop("inferplane.coalesce_max_inflight", None)
        return config


def python_backend_config(
    name: str,
    inputs: Mapping[str, Sequence[int]],
    outputs: Mapping[str, Sequence[int]],
    serving: ServingConfig = ServingConfig(),
    parameters: Mapping[str, str] | None = None,
) -> ModelConfig:
    """A complete config for a Python-backend model with FP32 tensors (dims without the batch dim)."""
    config = ModelConfig(name=name, backend="python")
    fp32 = model_config_pb2.TYPE_FP32
    for tensor, dims in inputs.items():
        config.input.add(name=tensor, data_type=fp32, dims=list(dims))
    for tensor, dims in outputs.items():
        config.output.add(name=tensor, data_type=fp32, dims=list(dims))
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    return serving.apply(config)


def to_text(config: ModelConfig) -> str:
    return text_format.MessageToString(config)


def write_config(config: ModelConfig, model_dir: Path) -> Path:
    """Write ``model_dir/config.pbtxt`` and return its path."""
    if not config.name:
        raise ValueError("a model config needs a name (Triton matches it to the directory)")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / CONFIG_FILE
    path.write_text(to_text(config), encoding="utf-8")
    return path


def read_config(path_or_dir: Path) -> ModelConfig:
    """Parse a ``config.pbtxt`` (or the one inside a model directory)."""
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / CONFIG_FILE
    return text_format.Parse(path.read_text(encoding="utf-8"), ModelConfig())


# ---- composite endpoints (server/control/composition/composition_compiler.py) ---------------------------

ENSEMBLE_PLATFORM = "ensemble"


@dataclass(frozen=True)
class EnsembleStep:
    """One step of a Triton ensemble: which model (and version; -1 the latest) and how its
    tensors map to the ensemble's (``input_map``: model input -> ensemble tensor, ``output_map``:
    model output -> ensemble tensor)."""

    model_name: str
    model_version: int
    input_map: Mapping[str, str]
    output_map: Mapping[str, str]


def ensemble_config(
    name: str,
    max_batch_size: int,
    inputs: Sequence[tuple[str, int, Sequence[int]]],
    outputs: Sequence[tuple[str, int, Sequence[int]]],
    steps: Sequence[EnsembleStep],
    parameters: Mapping[str, str] | None = None,
) -> ModelConfig:
    """A Triton ensemble (``platform: "ensemble"``, ``ensemble_scheduling``): tensors are
    ``(name, config data type, dims without the batch dim)``."""
    config = ModelConfig(name=name, platform=ENSEMBLE_PLATFORM, max_batch_size=max_batch_size)
    for tensor, data_type, dims in inputs:
        config.input.add(name=tensor, data_type=data_type, dims=list(dims))
    for tensor, data_type, dims in outputs:
        config.output.add(name=tensor, data_type=data_type, dims=list(dims))
    scheduling = config.ensemble_scheduling
    for step in steps:
        entry = scheduling.step.add(model_name=step.model_name, model_version=step.model_version)
        for key, value in step.input_map.items():
            entry.input_map[key] = value
        for key, value in step.output_map.items():
            entry.output_map[key] = value
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    return config


def operator_config(
    name: str,
    max_batch_size: int,
    inputs: Sequence[tuple[str, int, Sequence[int], bool]],
    output: tuple[str, int, Sequence[int]],
    parameters: Mapping[str, str],
    max_queue_delay_us: int = 100,
) -> ModelConfig:
    """A built-in operator (``adapters/composite_operator.py``) as a Python-backend model:
    inputs ``(name, data type, dims, optional)``, one output, its parameters (``op``, ``params``)."""
    config = ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    for tensor, data_type, dims, optional in inputs:
        config.input.add(name=tensor, data_type=data_type, dims=list(dims), optional=optional)
    tensor, data_type, dims = output
    config.output.add(name=tensor, data_type=data_type, dims=list(dims))
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    if max_batch_size > 0:
        config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    for key, value in parameters.items():
        config.parameters[key].string_value = str(value)
    return config
