"""Native backends (server/control/registry/backend_configs.py): which backend serves each format on which
Triton, and the config it gets — every format x backend written, then parsed back with protobuf's
text format into Triton's own ``ModelConfig`` (inference/model_config.proto)."""

from __future__ import annotations

import json

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as triton_model_config

from model_repository.adapters._common import session_providers
from model_repository.config_writer import ServingConfig, to_text
from server.control.registry import backend_configs as bc
from server.control.registry import safe_formats as sf
from server.errors import Conflict, DeployFailed, entry
from server.protogen.inference import model_config_pb2

SIG = {"inputs": [{"name": "features", "datatype": "FP32", "dims": [4]}], "outputs": [{"name": "score", "datatype": "FP32", "dims": [1]}]}
FIL_SIG = {"inputs": [{"name": "input__0", "datatype": "FP32", "dims": [4]}], "outputs": [{"name": "output__0", "datatype": "FP32", "dims": [1]}]}
CPU = bc.TritonTarget("cpu")  # the pytriton wheel: python only
GPU_FULL = bc.TritonTarget("gpu", frozenset({"python", "onnxruntime", "tensorrt", "fil", "vllm", "tensorrtllm"}), gpus=4)
GPU_PYTHON = bc.TritonTarget("gpu-py", frozenset({"python"}), gpus=1)
KIND = model_config_pb2.ModelInstanceGroup.Kind


def parsed(config) -> model_config_pb2.ModelConfig:
    """Write the config as config.pbtxt text; parse it with Triton's own, complete ModelConfig
    (tritonclient's copy of model_config.proto: an unknown field or a wrong type fails here), and
    return the platform's parse of it."""
    text = to_text(config)
    text_format.Parse(text, triton_model_config.ModelConfig())
    return text_format.Parse(text, model_config_pb2.ModelConfig())


# (format, hardware, targets, signature) -> (backend, platform, instance kind, gpus, parameters that must be set)
TABULAR = [
    (sf.ONNX, {}, [CPU], SIG, ("python", "", "KIND_CPU", [], {"providers": "CPUExecutionProvider"})),
    (sf.ONNX, {"gpus": 1}, [GPU_FULL], SIG,
     ("onnxruntime", "", "KIND_GPU", [0], {"inferplane.execution_providers": "CUDAExecutionProvider,CPUExecutionProvider"})),
    (sf.ONNX, {"gpus": 2, "execution_provider": "tensorrt"}, [GPU_FULL], SIG,
     ("onnxruntime", "", "KIND_GPU", [0, 1], {"inferplane.execution_providers": "TensorrtExecutionProvider,CUDAExecutionProvider,CPUExecutionProvider"})),
    (sf.ONNX, {"accelerator": "gpu"}, [GPU_PYTHON], SIG,
     ("python", "", "KIND_GPU", [0], {"providers": "CUDAExecutionProvider,CPUExecutionProvider"})),
    (sf.TENSORRT_PLAN, {"gpus": 1}, [CPU, GPU_FULL], SIG, ("tensorrt", "tensorrt_plan", "KIND_GPU", [0], {})),
    (sf.TENSORRT_PLAN, {}, [GPU_FULL], SIG, ("tensorrt", "tensorrt_plan", "KIND_GPU", [0], {})),
    (sf.TENSORRT_PLAN, {"gpus": 1}, [CPU, GPU_PYTHON], SIG, ("python", "", "KIND_GPU", [0], {"threads": "1"})),  # the plan adapter
    (sf.XGBOOST_JSON, {"gpus": 1}, [GPU_FULL], FIL_SIG, ("fil", "", "KIND_GPU", [0], {"model_type": "xgboost_json", "output_class": "false"})),
    (sf.XGBOOST_UBJ, {"gpus": 1}, [GPU_FULL], FIL_SIG, ("fil", "", "KIND_GPU", [0], {"model_type": "xgboost_ubj"})),
    (sf.LIGHTGBM_TEXT, {"gpus": 1}, [GPU_FULL], FIL_SIG, ("fil", "", "KIND_GPU", [0], {"model_type": "lightgbm"})),
    (sf.LIGHTGBM_TEXT, {"gpus": 1}, [GPU_FULL], SIG, ("python", "", "KIND_GPU", [0], {"threads": "1"})),  # FIL's tensor names only
    (sf.XGBOOST_JSON, {}, [CPU], SIG, ("python", "", "KIND_CPU", [], {"threads": "1"})),
    (sf.LIGHTGBM_TEXT, {}, [CPU], SIG, ("python", "", "KIND_CPU", [], {"threads": "1"})),
]


@pytest.mark.parametrize("fmt, hardware, targets, signature, want", TABULAR, ids=[f"{r[0]}-{r[4][0]}-{r[4][2]}" for r in TABULAR])
def test_tabular_configs_parse_as_tritons_model_config(fmt, hardware, targets, signature, want):
    backend, platform, kind, gpus, parameters = want
    choice = bc.choose(fmt, hardware, targets, signature)
    assert choice.backend == backend
    config = parsed(bc.tabular_config("m", signature, ServingConfig(instances=2), [3, 1], choice, fmt))
    assert config.name == "m" and config.backend == backend and config.platform == platform
    assert [g.kind for g in config.instance_group] == [KIND.Value(kind)]
    assert config.instance_group[0].count == 2 and list(config.instance_group[0].gpus) == gpus
    assert list(config.version_policy.specific.versions) == [1, 3]
    assert [t.name for t in config.input] == [t["name"] for t in signature["inputs"]]
    assert config.input[0].data_type == model_config_pb2.TYPE_FP32 and list(config.input[0].dims) == [4]
    assert config.dynamic_batching.max_queue_delay_microseconds == 200 and config.max_batch_size == 64
    for key, value in parameters.items():
        assert config.parameters[key].string_value == value, key
    if choice.native:
        assert config.default_model_filename == sf.FILE_NAMES[fmt]
        assert "threads" not in config.parameters  # the adapters' parameter, not a native backend's
    else:
        assert choice.adapter == bc.ADAPTERS.get(fmt, bc.PLAN_ADAPTER) and not config.default_model_filename


def test_the_tensorrt_execution_provider_is_an_execution_accelerator():
    choice = bc.choose(sf.ONNX, {"gpus": 1, "execution_provider": "tensorrt"}, [GPU_FULL])
    config = parsed(bc.tabular_config("m", SIG, ServingConfig(), [1], choice, sf.ONNX))
    (trt,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert trt.name == "tensorrt" and trt.parameters["precision_mode"] == "FP16"
    plain = parsed(bc.tabular_config("m", SIG, ServingConfig(), [1], bc.choose(sf.ONNX, {"gpus": 1}, [GPU_FULL]), sf.ONNX))
    assert not plain.optimization.execution_accelerators.gpu_execution_accelerator


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_vllm_config_and_engine_arguments_carry_tensor_parallel(gpus):
    choice = bc.choose(sf.SAFETENSORS, {"gpus": gpus, "engine": "vllm"}, [GPU_FULL])
    assert (choice.backend, choice.kind, choice.gpus) == ("vllm", "KIND_MODEL", gpus)
    generated = bc.llm_engine_config("chat", [2], choice, "/models/chat/2/hf", {"max_model_len": 4096})
    config = parsed(generated.config)
    assert config.backend == "vllm" and config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert [g.kind for g in config.instance_group] == [KIND.Value("KIND_MODEL")]
    assert {t.name for t in config.input} >= {"text_input", "stream", "sampling_parameters"}
    assert [t.name for t in config.output] == ["text_output"] and config.input[0].data_type == model_config_pb2.TYPE_STRING
    args = json.loads(generated.files["model.json"])
    assert args["tensor_parallel_size"] == gpus and args["model"] == "/models/chat/2/hf" and args["max_model_len"] == 4096


def test_tensorrtllm_config():
    choice = bc.choose(sf.SAFETENSORS, {"gpus": 2, "engine": "tensorrt-llm"}, [GPU_FULL])
    config = parsed(bc.llm_engine_config("chat", [1], choice, "/models/chat/1/engine").config)
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert config.parameters["gpt_model_type"].string_value == "inflight_fused_batching"
    assert config.parameters["gpt_model_path"].string_value == "/models/chat/1/engine"
    assert config.parameters["inferplane.tensor_parallel"].string_value == "2"
    assert {t.name for t in config.input} >= {"input_ids", "input_lengths", "request_output_len"}


def test_an_llm_on_cpu_runs_our_engine_adapter():
    choice = bc.choose(sf.SAFETENSORS, {}, [CPU])
    assert (choice.backend, choice.adapter, choice.kind) == ("python", "llm_engine.py", "KIND_CPU")
    with pytest.raises(ValueError):
        bc.llm_engine_config("chat", [1], choice, "/x")
    config = parsed(bc.llm_adapter_config("chat", [2, 1], choice, {"kv_cache_memory": "16MiB", "max_loras": 4, "gpus": 0}))
    assert config.backend == "python" and config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert list(config.version_policy.specific.versions) == [1, 2]
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert (params["engine"], params["kv_cache_memory"], params["max_loras"], params["tensor_parallel"]) == ("cpu", "16MiB", "4", "1")
    assert "artifact_sha256" not in params  # each version's digest is pinned by the deployer's shim, not the shared config
    assert {t.name for t in config.input} == {"text_input", "messages", "parameters"} and {t.name for t in config.output} == {"text_output", "info"}
    with pytest.raises(Conflict, match="max_loras"):
        bc.llm_adapter_config("chat", [1], choice, {"max_loras": "many"})


@pytest.mark.parametrize("gpus", [1, 2])
def test_vllm_without_the_native_backend_runs_through_the_engine_adapter_with_tensor_parallel(gpus):
    two = bc.TritonTarget("two-py", frozenset({"python"}), gpus=2)
    choice = bc.choose(sf.SAFETENSORS, {"gpus": gpus, "engine": "vllm"}, [CPU, two])
    assert (choice.backend, choice.adapter, choice.engine, choice.replicas) == ("python", "llm_engine.py", "vllm", ("two-py",))
    params = parsed(bc.llm_adapter_config("chat", [1], choice, {"gpus": gpus})).parameters
    assert (params["engine"].string_value, params["tensor_parallel"].string_value) == ("vllm", str(gpus))
    assert bc.choose(sf.SAFETENSORS, {"engine": "auto"}, [CPU]).engine == "auto"


@pytest.mark.parametrize(
    "fmt, hardware, backend",
    [(sf.TENSORRT_PLAN, {"gpus": 1}, "tensorrt"), (sf.SAFETENSORS, {"gpus": 2, "engine": "vllm"}, "vllm"),
     (sf.SAFETENSORS, {"engine": "tensorrt-llm"}, "tensorrtllm")],
)  # fmt: skip
def test_a_format_whose_backend_exists_nowhere_is_refused_naming_both(fmt, hardware, backend):
    with pytest.raises(bc.MissingBackend) as caught:
        bc.choose(fmt, hardware, [CPU, GPU_PYTHON] if fmt == sf.SAFETENSORS else [CPU])
    assert fmt in caught.value.message and f"'{backend}'" in caught.value.message and "python" in caught.value.message
    mapped = entry(caught.value)
    assert mapped.http_status == 409 and mapped.grpc_code.name == "FAILED_PRECONDITION"


def test_gpu_counts_come_from_the_hardware_metadata_and_a_target_must_have_them():
    assert bc.gpus_wanted({"gpus": 2}) == 2 and bc.gpus_wanted({"accelerator": "gpu"}) == 1 and bc.gpus_wanted({}) == 0
    assert bc.gpus_wanted({"gpus": True}) == 0 and bc.gpus_wanted({"gpus": -1}) == 0
    two = bc.TritonTarget("two", frozenset({"python", "vllm"}), gpus=2)
    assert bc.choose(sf.SAFETENSORS, {"gpus": 2, "engine": "vllm"}, [GPU_PYTHON, two]).replicas == ("two",)
    with pytest.raises(bc.MissingBackend, match="4 GPU"):
        bc.choose(sf.SAFETENSORS, {"gpus": 4, "engine": "vllm"}, [two])
    with pytest.raises(bc.MissingBackend, match="'python'"):
        bc.choose(sf.ONNX, {"gpus": 1}, [CPU])  # a GPU model, no Triton with a GPU
    with pytest.raises(Conflict, match="unknown LLM engine"):
        bc.choose(sf.SAFETENSORS, {"engine": "llamacpp"}, [CPU])


def test_backends_are_observed_from_the_backend_directory(tmp_path):
    for name, marker in (("python", "libtriton_python.so"), ("onnxruntime", "libtriton_onnxruntime.so"), ("vllm", "model.py")):
        (tmp_path / name).mkdir()
        (tmp_path / name / marker).write_bytes(b"")
    (tmp_path / "empty").mkdir()  # a folder without a backend library is no backend
    (tmp_path / "stray.txt").write_text("")
    assert bc.observe_backends(tmp_path) == {"python", "onnxruntime", "vllm"}
    assert bc.observe_backends(tmp_path / "missing") == frozenset()
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_bytes(b"")
    assert bc.observe_gpus(dev) == 2 and bc.observe_gpus(tmp_path / "nodev") == 0


def test_the_pytriton_wheel_has_the_python_backend():
    from server.runtime.triton_install import TritonInstallation

    assert "python" in bc.observe_backends(TritonInstallation.find().root / "backends")


def test_the_onnx_adapter_opens_the_providers_the_config_names():
    assert session_providers("", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    both = "CUDAExecutionProvider,CPUExecutionProvider"
    assert session_providers(both, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(RuntimeError, match="CUDAExecutionProvider.*onnxruntime-gpu"):
        session_providers(both, ["CPUExecutionProvider"])


# ---- the deployer: the choice made on the replicas' observed backends --------------------------

PLAN = b"ftrt" + bytes(range(256)) * 4  # a TensorRT plan header (safe_formats recognises it by its bytes)


@pytest.fixture
def deploy_setup(tmp_path):
    from server.control.registry.artifacts import ArtifactStore
    from server.control.rollout.deployer import Deployer
    from server.control.registry.registry import Registry
    from tests.unit.test_registry import SIGNATURE, lightgbm
    from tests.unit.test_registry_deployer import FakeDataPlane

    registry = Registry(f"sqlite:///{tmp_path}/r.db", ArtifactStore(tmp_path / "store"))
    registry.register("plan", PLAN, signature=SIGNATURE, filename="model.plan", hardware={"gpus": 1})
    registry.register("trees", lightgbm(2), signature=SIGNATURE, hardware={"gpus": 1})
    dp = FakeDataPlane(tmp_path / "repo")
    yield registry, Deployer(registry, dp, tmp_path / "repo", grace_s=3600), tmp_path / "repo"
    registry.close()


async def test_a_plan_is_refused_where_no_triton_has_tensorrt(deploy_setup):
    registry, deployer, repo = deploy_setup
    with pytest.raises(bc.MissingBackend, match="tensorrt-plan needs Triton's 'tensorrt' backend") as caught:
        await deployer.deploy("plan:1")
    assert entry(caught.value).http_status == 409 and not (repo / "plan").exists()
    assert registry.audit_log(1)[0].outcome == "failed"


async def test_a_plan_deploys_to_tensorrt_on_a_gpu_replica_and_trees_to_the_adapter_on_the_gpu(deploy_setup):
    from model_repository.config_writer import read_config

    registry, deployer, repo = deploy_setup
    deployer.targets = lambda: [CPU, GPU_FULL]
    await deployer.deploy("plan:1")
    config = read_config(repo / "plan")
    assert (config.backend, config.platform, config.default_model_filename) == ("tensorrt", "tensorrt_plan", "model.plan")
    assert config.instance_group[0].kind == KIND.Value("KIND_GPU") and list(config.instance_group[0].gpus) == [0]
    # a native backend reads the artifact itself: no adapter, no shim in the version directory
    assert {p.name for p in (repo / "plan" / "1").iterdir()} == {"model.plan", "inferplane_version.json"}
    await deployer.deploy("trees:1")  # SIGNATURE's tensor names are not FIL's: the LightGBM adapter, on the GPU
    trees = read_config(repo / "trees")
    assert trees.backend == "python" and trees.instance_group[0].kind == KIND.Value("KIND_GPU")
    assert "model.py" in {p.name for p in (repo / "trees" / "1").iterdir()}
    await deployer.stop()


async def test_a_plan_goes_to_the_plan_adapter_on_a_gpu_triton_without_tensorrt(deploy_setup):
    from model_repository.config_writer import read_config

    registry, deployer, repo = deploy_setup
    deployer.targets = lambda: [CPU, GPU_PYTHON]
    await deployer.deploy("plan:1")
    config = read_config(repo / "plan")
    assert config.backend == "python" and config.instance_group[0].kind == KIND.Value("KIND_GPU")
    files = {p.name for p in (repo / "plan" / "1").iterdir()}
    assert {"model.py", "_adapter.py", "_common.py", "_tensorrt.py", "model.plan"} <= files
    assert "plan_predictor" in (repo / "plan" / "1" / "_adapter.py").read_text()
    await deployer.stop()


def _llm_weights() -> bytes:
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(16)


async def test_an_llm_version_deploys_to_the_engine_adapter_with_its_companions_in_one_folder(deploy_setup):
    from model_repository.config_writer import read_config

    registry, deployer, repo = deploy_setup
    record, _ = registry.register("chat", _llm_weights(), companions={"config.json": b"{}", "tokenizer.json": b'{"v": 1}'}, hardware={"kv_cache_memory": "16MiB"})
    result = await deployer.deploy("chat:1")
    assert result.version == 1 and deployer.dp.generated == [("chat", "1")]  # warmed with a generation pinned to it
    config = read_config(repo / "chat")
    assert config.backend == "python" and config.model_transaction_policy.decoupled
    assert config.parameters["engine"].string_value == "cpu" and config.parameters["kv_cache_memory"].string_value == "16MiB"
    version = repo / "chat" / "1"
    assert {p.name for p in (version / "hf").iterdir()} == {"model.safetensors", "config.json", "tokenizer.json"}
    assert (version / "hf" / "tokenizer.json").read_bytes() == b'{"v": 1}'
    assert {"model.py", "_adapter.py", "_common.py", "_llm_core.py", "_vllm_core.py", "_lora.py", "kv_budget.py", "llm_scheduler.py"} <= {p.name for p in version.iterdir()}
    assert "class TritonPythonModel" in (version / "_adapter.py").read_text() and "llm" in (version / "_adapter.py").read_text()
    pinned = json.loads((version / "inferplane_version.json").read_text())
    assert (pinned["artifact"], pinned["sha256"]) == ("hf", record.sha256)
    await deployer.stop()


async def test_an_llm_whose_warm_up_generation_fails_is_not_deployed(deploy_setup):
    registry, deployer, repo = deploy_setup
    registry.register("chat", _llm_weights(), companions={"config.json": b"{}"})
    original = deployer._materialize

    def materialize(record, version_dir):
        original(record, version_dir)
        (version_dir / "FAIL_WARMUP").write_text("")

    deployer._materialize = materialize
    with pytest.raises(DeployFailed, match="warm-up generation"):
        await deployer.deploy("chat:1")
    assert deployer.dp.live_version("chat") is None and not (repo / "chat").exists()


async def test_an_llm_deploys_to_the_native_vllm_backend_with_tensor_parallel_from_its_gpus(deploy_setup):
    from model_repository.config_writer import read_config

    registry, deployer, repo = deploy_setup
    deployer.targets = lambda: [CPU, GPU_FULL]
    registry.register("chat", _llm_weights(), companions={"config.json": b"{}"}, hardware={"gpus": 2, "engine": "vllm"})
    await deployer.deploy("chat:1")
    assert read_config(repo / "chat").backend == "vllm"
    args = json.loads((repo / "chat" / "1" / "model.json").read_text())
    assert args["tensor_parallel_size"] == 2 and args["model"] == str(repo / "chat" / "1" / "hf")
    assert not (repo / "chat" / "1" / "model.py").exists() and (repo / "chat" / "1" / "hf" / "model.safetensors").is_file()
    await deployer.stop()

async def test_install_deploys_an_llm_into_the_repository_before_triton_starts_and_start_routes_it(deploy_setup):
    from model_repository.config_writer import read_config

    registry, deployer, repo = deploy_setup
    registry.register("chat", _llm_weights(), companions={"config.json": b"{}"}, hardware={"max_loras": 4})
    record = deployer.install("chat", actor="demo")
    assert record.version == 1 and (repo / "chat" / "1" / "hf" / "model.safetensors").is_file()
    config = read_config(repo / "chat")
    assert list(config.version_policy.specific.versions) == [1] and config.parameters["max_loras"].string_value == "4"
    deployer.install("chat:1", actor="demo")  # again (the next demo build): no second deployment on the stack
    assert [d.version for d in registry.endpoint("chat").history] == [1]
    await deployer.dp.load_model("chat")  # what Triton does at start with the repository
    await deployer.start()
    assert deployer.dp.live_version("chat") == "1"
    await deployer.stop()
