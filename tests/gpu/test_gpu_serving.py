"""What needs a GPU, end to end through the real stack (frontend + embedded Triton on the GPU):

* an ONNX model registered with ``gpus=1`` deploys with ``KIND_GPU`` and the CUDA execution provider
  (the native ``onnxruntime`` backend where the Triton has it, the ONNX Runtime adapter otherwise)
  and answers as the CPU did;
* a TensorRT plan built by the optimizer from that ONNX model registers, deploys (native
  ``tensorrt`` backend or the plan adapter) and answers within FP16 tolerance;
* an LLM on vLLM on CUDA (tensor parallel 1) streams through the OpenAI API;
* the GPU metrics (utilization, memory) are exported.

Run with ``tests/gpu/run.sh`` (it installs onnxruntime-gpu, tensorrt and vLLM from the package index).
"""

from __future__ import annotations

import io
import json
import os
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from model_repository import demo
from model_repository.config_writer import read_config
from server.protogen.inferplane.v1 import admin_pb2, admin_pb2_grpc
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _signature(bundle) -> dict:
    return {"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs]}


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    repository = root / "model_repository"
    repository.mkdir()
    stack = start_stack(repository, root / "stack", env={"INFERPLANE_DEPLOY_TIMEOUT_S": "300"}, timeout=600)
    stack.root = root
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def admin(gpu_stack):
    with grpc.insecure_channel(gpu_stack.grpc) as channel:
        yield admin_pb2_grpc.AdminStub(channel)


def _infer(stack, model: str, rows: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(stack.grpc)
    try:
        x = grpcclient.InferInput("features", list(rows.shape), "FP32")
        x.set_data_from_numpy(rows)
        result = client.infer(model, [x])
        return result.as_numpy(result.get_response().outputs[0].name)
    finally:
        client.close()


def _register_and_deploy(admin, name: str, artifact: bytes, filename: str, bundle, validation: bool = True) -> None:
    request = admin_pb2.RegisterModelRequest(
        name=name, artifact=artifact, filename=filename, signature_json=json.dumps(_signature(bundle)),
        hardware_json=json.dumps({"gpus": 1}),
        validation_npz=_npz(features=bundle.features, expected=bundle.expected) if validation else b"",
    )  # fmt: skip
    admin.RegisterModel(request, timeout=120)
    admin.Deploy(admin_pb2.DeployRequest(ref=f"{name}:1"), timeout=600)


def test_onnx_deploys_on_the_gpu_through_the_cuda_provider(gpu_stack, admin):
    bundle = demo.mlp_classifier()
    _register_and_deploy(admin, "mlp_gpu", bundle.artifact, bundle.artifact_name, bundle)
    config = read_config(gpu_stack.root / "model_repository" / "mlp_gpu")
    assert config.instance_group[0].kind == config.instance_group[0].KIND_GPU and list(config.instance_group[0].gpus) == [0]
    providers = config.parameters["inferplane.execution_providers" if config.backend == "onnxruntime" else "providers"].string_value
    assert providers.startswith("CUDAExecutionProvider")
    rows = np.ascontiguousarray(bundle.features[:16])
    assert np.allclose(_infer(gpu_stack, "mlp_gpu", rows), bundle.expected[:16], rtol=1e-3, atol=1e-4)


def test_a_tensorrt_plan_built_by_the_optimizer_is_served(gpu_stack, admin):
    from optimizer import tensorrt

    assert tensorrt.unavailable() == "", tensorrt.unavailable()
    bundle = demo.mlp_classifier()
    spec = bundle.inputs[0]
    plan = tensorrt.build_plan(bundle.artifact, spec.name, spec.dims, max_batch=64, fp16=True)
    _register_and_deploy(admin, "mlp_plan", plan, "model.plan", bundle, validation=False)  # FP16: not bit-equal to the set
    config = read_config(gpu_stack.root / "model_repository" / "mlp_plan")
    assert config.backend in ("tensorrt", "python") and config.instance_group[0].kind == config.instance_group[0].KIND_GPU
    rows = np.ascontiguousarray(bundle.features[:16])
    assert np.allclose(_infer(gpu_stack, "mlp_plan", rows), bundle.expected[:16], rtol=2e-2, atol=2e-2)


def test_gpu_metrics_are_exported(gpu_stack):
    def scraped() -> str:
        return urllib.request.urlopen(f"http://{gpu_stack.metrics}/metrics", timeout=10).read().decode()

    assert wait_until(lambda: "inferplane_gpu_utilization{" in scraped(), timeout=60), "no inferplane_gpu_utilization series"
    text = scraped()
    assert "inferplane_gpu_memory_used_bytes{" in text and "inferplane_gpu_memory_total_bytes{" in text


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    import dataclasses

    from model_repository.llm import TINY_SETTINGS
    from server.control.rollout.llm_install import install_llm_models

    python = os.environ.get("INFERPLANE_VLLM_PYTHON", "")
    assert python and Path(python).exists(), "set INFERPLANE_VLLM_PYTHON to a vLLM environment's python (tests/gpu/run.sh builds one)"
    root = tmp_path_factory.mktemp("gpu_llm")
    repository = root / "model_repository"
    # from the registry with engine vllm in its hardware metadata (the tiny model's own settings are our CPU engine's)
    install_llm_models(repository, tiny=True, work=root, tiny_settings=dataclasses.replace(TINY_SETTINGS, engine="vllm"))
    stack = start_stack(repository, root / "stack", env={"INFERPLANE_VLLM_PYTHON": python}, timeout=900)
    yield stack
    stop_stack(stack)


def test_vllm_on_cuda_with_tensor_parallel_1_streams_through_the_openai_api(vllm_stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{vllm_stack.http}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        parts, reasons = [], []
        for chunk in client.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "hello"}],
                                                    max_tokens=8, temperature=0, stream=True):  # fmt: skip
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                if choice.finish_reason is not None:
                    reasons.append(choice.finish_reason)
        assert reasons == ["length"] and "".join(parts)
    finally:
        client.close()
    with urllib.request.urlopen(f"http://{vllm_stack.http}/v2/models/tiny_llama/engine_stats", timeout=30) as r:
        stats = json.loads(r.read())
    assert stats.get("engine") == "vllm", stats  # vLLM, not the CPU engine, served it
