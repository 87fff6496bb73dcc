"""Which Triton backend serves a registered version, and its ``config.pbtxt`` (pure).

The design card's native backends replace the Python-backend adapters where a Triton has them:

| format | GPU Triton with the backend | otherwise |
|---|---|---|
| ONNX | ``onnxruntime`` (CUDA EP; TensorRT EP as an execution accelerator when asked) | ``python`` + ``onnx_runtime.py`` |
| TensorRT plan | ``tensorrt`` (``platform: tensorrt_plan``) | ``python`` + ``tensorrt_runtime.py`` on a GPU; refused without one |
| XGBoost JSON/UBJ, LightGBM text | ``fil`` (FIL's tensor names ``input__0``/``output__0``) | ``python`` + the framework adapter |
| safetensors LLM | ``vllm`` or ``tensorrtllm``, as the version's ``engine`` chooses | ``python`` + ``llm_engine.py`` (the CPU engine, or vLLM from ``.venv-vllm``) |

Which backends a Triton has is observed (:func:`observe_backends`: the folders of its backend
directory) and recorded per replica; :func:`choose` picks the backend from the version's format,
its hardware metadata (``gpus``, ``accelerator``, ``engine``) and what the replicas have, and
raises :class:`MissingBackend` (FAILED_PRECONDITION / 409) naming the format and the backend that
exists nowhere. Configs are built from Triton's model-config protobuf, never templated
(STYLE.md 10); tests parse them back with ``text_format``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_repository.config_writer import ModelConfig, ServingConfig
from model_repository.llm import engine_settings, llm_config
from server.control.registry import safe_formats
from server.dataplane import codecs
from server.errors import Conflict
from server.protogen.inference import model_config_pb2

PYTHON = "python"
ONNXRUNTIME = "onnxruntime"
TENSORRT = "tensorrt"
FIL = "fil"
VLLM = "vllm"
TENSORRTLLM = "tensorrtllm"
NATIVE = (ONNXRUNTIME, TENSORRT, FIL, VLLM, TENSORRTLLM)

# formats the Python-backend adapters run, and through which adapter
ADAPTERS = {
    safe_formats.ONNX: "onnx_runtime.py",
    safe_formats.XGBOOST_JSON: "xgboost_runtime.py",
    safe_formats.XGBOOST_UBJ: "xgboost_runtime.py",
    safe_formats.LIGHTGBM_TEXT: "lightgbm_runtime.py",
}
PLAN_ADAPTER, PLAN_HELPERS = "tensorrt_runtime.py", ("_tensorrt.py",)  # a plan through the Python backend (GPU)
TREE_FORMATS = (safe_formats.XGBOOST_JSON, safe_formats.XGBOOST_UBJ, safe_formats.LIGHTGBM_TEXT)
FIL_MODEL_TYPES = {safe_formats.XGBOOST_JSON: "xgboost_json", safe_formats.XGBOOST_UBJ: "xgboost_ubj", safe_formats.LIGHTGBM_TEXT: "lightgbm"}
FIL_TENSORS = ("input__0", "output__0")  # the FIL backend serves exactly these names
LLM_ENGINES = {"vllm": VLLM, "tensorrt-llm": TENSORRTLLM, "tensorrtllm": TENSORRTLLM, "cpu": PYTHON, "auto": PYTHON}
LLM_ADAPTER = "llm_engine.py"  # model_repository/llm.py installs it with its modules
ORT_GPU_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
ORT_TRT_PROVIDERS = ("TensorrtExecutionProvider", *ORT_GPU_PROVIDERS)
ORT_CPU_PROVIDERS = ("CPUExecutionProvider",)

_GROUP = model_config_pb2.ModelInstanceGroup


class MissingBackend(Conflict):
    """No Triton this deployer reaches has the backend the version's format needs."""


@dataclass(frozen=True)
class TritonTarget:
    """What one Triton (a replica) offers: its backends (observed) and its GPUs."""

    id: str
    backends: frozenset[str] = frozenset({PYTHON})
    gpus: int = 0


@dataclass(frozen=True)
class Choice:
    """The backend that serves a version, where, and how (the config's device side)."""

    backend: str
    adapter: str = ""  # Python backend: the adapter file (model_repository/adapters/)
    kind: str = "KIND_CPU"  # KIND_CPU | KIND_GPU | KIND_MODEL (the engine places itself)
    gpus: int = 0  # GPUs one instance uses (tensor parallel for an LLM engine)
    providers: tuple[str, ...] = ()  # ONNX Runtime execution providers, best first
    replicas: tuple[str, ...] = ()  # the targets that have the backend
    note: str = ""  # why this backend (when it is not the best one for the format)
    helpers: tuple[str, ...] = ()  # more adapter files the Python backend's model.py imports
    engine: str = ""  # an LLM through the Python backend: the engine adapter's engine (cpu | vllm | auto)

    @property
    def native(self) -> bool:
        return self.backend != PYTHON


@dataclass(frozen=True)
class Generated:
    config: ModelConfig
    files: dict[str, str] = field(default_factory=dict)  # extra files for the version directory (vLLM's model.json)


def observe_backends(directory: Path | str) -> frozenset[str]:
    """The backends a Triton has: the folders of its ``--backend-directory`` that hold a
    ``libtriton_NAME.so`` (or, for the Python-based ones such as vLLM, a ``model.py``)."""
    root = Path(directory)
    if not root.is_dir():
        return frozenset()
    found = set()
    for entry in root.iterdir():
        if entry.is_dir() and ((entry / f"libtriton_{entry.name}.so").exists() or (entry / "model.py").exists()):
            found.add(entry.name)
    return frozenset(found)


def observe_gpus(dev: Path | str = "/dev") -> int:
    """The NVIDIA GPUs this machine shows (``/dev/nvidia0``, ``/dev/nvidia1``, ...)."""
    root = Path(dev)
    if not root.is_dir():
        return 0
    return sum(1 for entry in root.glob("nvidia*") if entry.name[len("nvidia"):].isdigit())


def gpus_wanted(hardware: Mapping[str, Any] | None) -> int:
    """GPUs one copy needs, from the version's hardware metadata (``gpus``; ``accelerator: gpu`` is 1)."""
    hardware = hardware or {}
    value = hardware.get("gpus")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 1 if str(hardware.get("accelerator", "")).lower() in ("gpu", "cuda") else 0


def _with(targets: Iterable[TritonTarget], backend: str, gpus: int) -> tuple[str, ...]:
    return tuple(t.id for t in targets if backend in t.backends and t.gpus >= gpus)


def choose(fmt: str, hardware: Mapping[str, Any] | None, targets: Iterable[TritonTarget], signature: Mapping[str, Any] | None = None) -> Choice:
    """The best backend for ``fmt`` that some target has; :class:`MissingBackend` when none has one."""
    targets = list(targets)
    hardware = hardware or {}
    gpus = gpus_wanted(hardware)
    on_gpu = max(gpus, 1)

    def missing(backend: str, why: str = "") -> MissingBackend:
        have = sorted({b for t in targets for b in t.backends}) or ["none"]
        where = f" with {gpus} GPU(s)" if gpus else ""
        return MissingBackend(
            f"{fmt} needs Triton's '{backend}' backend{where}, which no Triton here has (they have: {', '.join(have)}){why}; "
            f"deploy it where a Triton with '{backend}' runs"
        )

    def python(adapter: str, note: str = "", providers: tuple[str, ...] = ()) -> Choice:
        hosts = _with(targets, PYTHON, gpus)
        if not hosts:
            raise missing(PYTHON)
        kind = "KIND_GPU" if gpus else "KIND_CPU"
        return Choice(PYTHON, adapter, kind, gpus, providers, hosts, note)

    if fmt == safe_formats.TENSORRT_PLAN:
        hosts = _with(targets, TENSORRT, on_gpu)
        if hosts:
            return Choice(TENSORRT, kind="KIND_GPU", gpus=on_gpu, replicas=hosts)
        hosts = _with(targets, PYTHON, on_gpu)
        if not hosts:
            raise missing(TENSORRT, " (a TensorRT plan runs only on a GPU: natively, or through the plan adapter)")
        return Choice(PYTHON, PLAN_ADAPTER, "KIND_GPU", on_gpu, (), hosts, "no Triton with the tensorrt backend: the plan adapter on the GPU", PLAN_HELPERS)
    if fmt == safe_formats.ONNX:
        providers = ORT_TRT_PROVIDERS if str(hardware.get("execution_provider", "")).lower() == "tensorrt" else ORT_GPU_PROVIDERS
        if gpus:
            hosts = _with(targets, ONNXRUNTIME, gpus)
            if hosts:
                return Choice(ONNXRUNTIME, kind="KIND_GPU", gpus=gpus, providers=providers, replicas=hosts)
            return python(ADAPTERS[fmt], "no Triton with the onnxruntime backend and a GPU: the ONNX Runtime adapter on the GPU", providers)
        hosts = _with(targets, ONNXRUNTIME, 0)
        if hosts and not _with(targets, PYTHON, 0):
            return Choice(ONNXRUNTIME, providers=ORT_CPU_PROVIDERS, replicas=hosts)
        return python(ADAPTERS[fmt], providers=ORT_CPU_PROVIDERS)
    if fmt in TREE_FORMATS:
        if gpus and _with(targets, FIL, gpus):
            if _fil_names(signature):
                return Choice(FIL, kind="KIND_GPU", gpus=gpus, replicas=_with(targets, FIL, gpus))
            return python(ADAPTERS[fmt], f"the fil backend serves only tensors named {FIL_TENSORS[0]}/{FIL_TENSORS[1]}: the Python adapter")
        return python(ADAPTERS[fmt])
    if fmt == safe_formats.SAFETENSORS:
        engine = str(hardware.get("engine", "cpu" if not gpus else "vllm")).lower()
        backend = LLM_ENGINES.get(engine)
        if backend is None:
            raise Conflict(f"unknown LLM engine {engine!r}; one of {', '.join(sorted(LLM_ENGINES))}")
        hosts = _with(targets, backend, on_gpu) if backend != PYTHON else ()
        if hosts:
            return Choice(backend, kind="KIND_MODEL", gpus=on_gpu, replicas=hosts)
        if backend == TENSORRTLLM or (backend == VLLM and not _with(targets, PYTHON, gpus)):
            raise missing(backend)
        # our engine adapter: the CPU engine, or vLLM from its own environment (.venv-vllm) where Triton has no vllm backend
        note = "" if backend == PYTHON else "no Triton with the vllm backend: vLLM through the engine adapter"
        return Choice(PYTHON, LLM_ADAPTER, "KIND_CPU", gpus, (), _with(targets, PYTHON, gpus), note, engine="vllm" if backend == VLLM else engine)
    raise Conflict(f"no Triton backend serves format {fmt!r}")


def _fil_names(signature: Mapping[str, Any] | None) -> bool:
    if not signature:
        return False
    names = ([t["name"] for t in signature["inputs"]], [t["name"] for t in signature["outputs"]])
    return names == ([FIL_TENSORS[0]], [FIL_TENSORS[1]])


# ---- configs --------------------------------------------------------------------------------


def _wire_to_config(datatype: str) -> int:
    wire = {v: k for k, v in codecs.CONFIG_TO_WIRE.items()}
    return model_config_pb2.DataType.Value(wire[datatype])


def _tensors(config: ModelConfig, signature: Mapping[str, Any]) -> None:
    for t in signature["inputs"]:
        config.input.add(name=t["name"], data_type=_wire_to_config(t["datatype"]), dims=list(t["dims"]))
    for t in signature["outputs"]:
        config.output.add(name=t["name"], data_type=_wire_to_config(t["datatype"]), dims=list(t["dims"]))


def _device(config: ModelConfig, choice: Choice, count: int) -> None:
    """Instance groups: ``count`` instances on GPU 0..gpus-1 (KIND_GPU), on CPU, or placed by the engine."""
    del config.instance_group[:]
    kind = _GROUP.Kind.Value(choice.kind)
    group = config.instance_group.add(kind=kind, count=count)
    if choice.kind == "KIND_GPU":
        group.gpus.extend(range(max(choice.gpus, 1)))


def tabular_config(name: str, signature: Mapping[str, Any], serving: ServingConfig, versions: list[int], choice: Choice, fmt: str = "") -> ModelConfig:
    """A batched model's config (ONNX, TensorRT, trees) for ``choice``: declared tensors, serving
    fields, pinned versions; the backend's own fields on top."""
    config = ModelConfig(name=name)
    _tensors(config, signature)
    config.version_policy.specific.versions.extend(sorted(set(versions)))
    serving.apply(config)
    _device(config, choice, serving.instances)
    if choice.backend == PYTHON:
        config.backend = PYTHON
        if choice.providers:
            config.parameters["providers"].string_value = ",".join(choice.providers)
        return config
    config.parameters.pop("threads", None)  # the adapters' knob; native backends have their own
    if fmt:
        config.default_model_filename = safe_formats.FILE_NAMES[fmt]
    if choice.backend == ONNXRUNTIME:
        config.backend = ONNXRUNTIME
        config.parameters["inferplane.execution_providers"].string_value = ",".join(choice.providers)
        config.parameters["intra_op_thread_count"].string_value = str(serving.threads)
        if "TensorrtExecutionProvider" in choice.providers:
            trt = config.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
            trt.parameters["precision_mode"] = "FP16"
            trt.parameters["max_workspace_size_bytes"] = str(1 << 30)
    elif choice.backend == TENSORRT:
        config.backend = TENSORRT
        config.platform = "tensorrt_plan"
    elif choice.backend == FIL:
        config.backend = FIL
        config.parameters["model_type"].string_value = FIL_MODEL_TYPES[fmt or safe_formats.XGBOOST_JSON]
        config.parameters["output_class"].string_value = "false"
        config.parameters["storage_type"].string_value = "AUTO"
    else:
        raise ValueError(f"{choice.backend} is not a batched-model backend")
    return config


def llm_adapter_config(name: str, versions: list[int], choice: Choice, hardware: Mapping[str, Any] | None) -> ModelConfig:
    """An LLM through the Python backend's engine adapter (``model_repository/llm.py``'s config: the
    engine's tensors, decoupled): the engine the choice names, ``tensor_parallel`` its GPUs, the
    version's engine settings from its hardware metadata; the artifact and its digest are pinned per
    version by the deployer's shim, so the shared config names neither."""
    try:
        settings = engine_settings(dict(hardware or {}), choice.engine or "cpu", max(choice.gpus, 1))
    except ValueError as err:
        raise Conflict(str(err)) from None
    config = llm_config(name, settings, "")
    config.parameters.pop("artifact_sha256", None)
    config.version_policy.specific.versions.extend(sorted(set(versions)))
    return config


def llm_engine_config(name: str, versions: list[int], choice: Choice, model_dir: str, engine: Mapping[str, str] | None = None) -> Generated:
    """A native LLM engine's config: decoupled (tokens stream), the engine places itself on its GPUs.

    ``vllm``: the vLLM backend's tensors (``text_input``, ``stream``, ``sampling_parameters`` ->
    ``text_output``) and ``model.json`` with the engine arguments, ``tensor_parallel_size`` = the
    GPUs. ``tensorrtllm``: the engine folder built for ``gpus``-way tensor parallelism, in-flight batching."""
    engine = dict(engine or {})
    config = ModelConfig(name=name, backend=choice.backend, max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    config.version_policy.specific.versions.extend(sorted(set(versions)))
    _device(config, choice, 1)
    string, boolean = model_config_pb2.TYPE_STRING, model_config_pb2.TYPE_BOOL
    files: dict[str, str] = {}
    if choice.backend == VLLM:
        config.input.add(name="text_input", data_type=string, dims=[1])
        config.input.add(name="stream", data_type=boolean, dims=[1], optional=True)
        config.input.add(name="sampling_parameters", data_type=string, dims=[1], optional=True)
        config.input.add(name="exclude_input_in_output", data_type=boolean, dims=[1], optional=True)
        config.output.add(name="text_output", data_type=string, dims=[-1])
        args = {
            "model": model_dir,
            "tensor_parallel_size": max(choice.gpus, 1),
            "gpu_memory_utilization": float(engine.pop("gpu_memory_utilization", 0.9)),
            "enable_prefix_caching": True,
            "disable_log_requests": True,
            **engine,
        }
        files["model.json"] = json.dumps(args, indent=2, sort_keys=True) + "\n"
    elif choice.backend == TENSORRTLLM:
        int32 = model_config_pb2.TYPE_INT32
        config.input.add(name="input_ids", data_type=int32, dims=[-1])
        config.input.add(name="input_lengths", data_type=int32, dims=[1])
        config.input.add(name="request_output_len", data_type=int32, dims=[1])
        config.input.add(name="streaming", data_type=boolean, dims=[1], optional=True)
        config.output.add(name="output_ids", data_type=int32, dims=[-1, -1])
        config.output.add(name="sequence_length", data_type=int32, dims=[-1])
        params = {
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": model_dir,
            "max_beam_width": "1",
            "batch_scheduler_policy": "max_utilization",
            "kv_cache_free_gpu_mem_fraction": "0.9",
            "inferplane.tensor_parallel": str(max(choice.gpus, 1)),
            **engine,
        }
        for key, value in params.items():
            config.parameters[key].string_value = str(value)
    else:
        raise ValueError(f"{choice.backend} is not an LLM engine backend")
    return Generated(config, files)
