"""LLMs from the registry against the real stack (frontend + Triton + registry): a tiny random Llama
built here as safetensors with its config and tokenizer registers as one version (the CLI streams
the files into the store), deploys to our CPU engine through the engine adapter, answers the openai
SDK, is canaried against a second version (other weights), rolled back, deployed and rolled back.

One stack for the module, started on an empty repository. v1 and v2 are the same architecture and
tokenizer with different random weights, so their greedy answers to one prompt differ: which
version answered is read from the text. The tests run in order and share the endpoint's state.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from model_repository.config_writer import read_config
from server.protogen.inferplane.v1 import admin_pb2
from server.protogen.inferplane.v1 import traffic_pb2 as tpb
from tests.conftest import registry_stack_fixtures

pytestmark = pytest.mark.integration

import openai  # noqa: E402

NAME = "chat_llama"
ACTOR = (("x-inferplane-actor", "ci-llm-registry"),)
MESSAGES = [{"role": "user", "content": "hello world, the capital city of france is"}]
ENGINE = ["engine=cpu", "threads=1", "kv_cache_memory=16MiB", "default_max_tokens=32"]


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Two tiny Llamas (same tokenizer, other weights) as Hugging Face folders."""
    from model_repository.llm import build_tiny_llama

    root = tmp_path_factory.mktemp("llamas")
    return build_tiny_llama(root / "v1", seed=11), build_tiny_llama(root / "v2", seed=22)


llm_registry_stack, channel, admin, traffic = registry_stack_fixtures(
    "llm_registry", lambda root: {"INFERPLANE_ROLLBACK_GRACE_S": "600", "INFERPLANE_DEPLOY_TIMEOUT_S": "120"}
)


@pytest.fixture(scope="module")
def client(llm_registry_stack):
    c = openai.OpenAI(base_url=f"http://{llm_registry_stack.http}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _register(stack, hf: Path, *extra: str) -> subprocess.CompletedProcess:
    """``inferplane models register NAME model.safetensors --companion ...``: the weights with every
    other file of the folder (config, tokenizer) as companions; no signature (an LLM's is the engine's)."""
    companions = [a for f in sorted(hf.iterdir()) if f.is_file() and f.name != "model.safetensors" for a in ("--companion", str(f))]
    hardware = [a for kv in ENGINE for a in ("--hardware", kv)]
    args = ["models", "register", NAME, str(hf / "model.safetensors"), *companions, *hardware, *extra]
    return subprocess.run([sys.executable, "-m", "server.cli.main", *args], capture_output=True, text=True, env=dict(os.environ, **stack.env), timeout=120)


def _answer(client) -> str:
    reply = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0.0)
    return reply.choices[0].message.content


def test_a_safetensors_llm_with_its_tokenizer_registers_as_one_version(llm_registry_stack, admin, llamas):
    v1, v2 = llamas
    first = _register(llm_registry_stack, v1)
    assert first.returncode == 0, first.stderr
    assert f"registered {NAME}:1" in first.stdout and "safetensors" in first.stdout
    again = _register(llm_registry_stack, v1)  # the same folder: the same version
    assert again.returncode == 0 and f"already registered as {NAME}:1" in again.stdout, again.stdout + again.stderr
    second = _register(llm_registry_stack, v2)
    assert second.returncode == 0 and f"registered {NAME}:2" in second.stdout, second.stdout + second.stderr
    shown = admin.ShowModel(admin_pb2.ShowModelRequest(name=NAME, version=1)).versions[0]
    assert shown.format == "safetensors" and shown.sha256 == _sha256(v1 / "model.safetensors")


def test_the_llm_deploys_to_the_cpu_engine_and_answers_the_openai_sdk(llm_registry_stack, admin, client):
    deployed = admin.Deploy(admin_pb2.DeployRequest(ref=f"{NAME}:1"), metadata=ACTOR, timeout=300)
    assert deployed.result.version == 1
    config = read_config(llm_registry_stack.repository / NAME)
    assert config.backend == "python" and config.model_transaction_policy.decoupled
    assert config.parameters["engine"].string_value == "cpu" and config.parameters["kv_cache_memory"].string_value == "16MiB"
    assert list(config.version_policy.specific.versions) == [1]
    version_dir = llm_registry_stack.repository / NAME / "1"
    assert (version_dir / "hf" / "model.safetensors").is_file() and (version_dir / "hf" / "tokenizer.json").is_file()
    assert NAME in {m.id for m in client.models.list().data}
    text = _answer(client)
    assert text and _answer(client) == text  # greedy: the same answer again
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0.0, stream=True)
        if c.choices
    )
    assert streamed == text


def test_a_second_version_is_canaried_then_rolled_back(llm_registry_stack, admin, traffic, client):
    stable = _answer(client)
    started = traffic.SetCanary(tpb.SetCanaryRequest(name=NAME, version=2, percent=50, interval_s=600, window_s=60), metadata=ACTOR).policy
    assert (started.kind, started.status, started.live) == ("canary", "active", "1")
    assert sorted(read_config(llm_registry_stack.repository / NAME).version_policy.specific.versions) == [1, 2]
    answers = [_answer(client) for _ in range(10)]
    canary = {a for a in answers if a != stable}
    assert len(canary) == 1 and answers.count(stable) == 5, answers  # half the calls, the other weights
    ended = traffic.Rollback(tpb.TrafficRollbackRequest(name=NAME), metadata=ACTOR).policy
    assert ended.status == "rolled_back"
    assert {_answer(client) for _ in range(4)} == {stable}


def test_the_second_version_deploys_and_rolls_back_like_any_model(llm_registry_stack, admin, client):
    v1_text = _answer(client)
    deployed = admin.Deploy(admin_pb2.DeployRequest(ref=f"{NAME}:2"), metadata=ACTOR, timeout=300)
    assert (deployed.result.version, deployed.result.previous) == (2, 1)
    v2_text = _answer(client)
    assert v2_text != v1_text
    rolled = admin.Rollback(admin_pb2.RollbackRequest(name=NAME), metadata=ACTOR, timeout=120)
    assert rolled.result.version == 1 and not rolled.result.reloaded  # v1 stayed loaded for the grace period: only the route moved
    assert _answer(client) == v1_text


def test_a_tensorrt_llm_engine_no_triton_here_has_is_refused_at_deploy(llm_registry_stack, admin, llamas):
    done = subprocess.run(
        [sys.executable, "-m", "server.cli.main", "models", "register", "trt_llama", str(llamas[0] / "model.safetensors"),
         "--companion", str(llamas[0] / "config.json"), "--hardware", "engine=tensorrt-llm", "--hardware", "gpus=2"],
        capture_output=True, text=True, env=dict(os.environ, **llm_registry_stack.env), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with pytest.raises(grpc.RpcError) as caught:
        admin.Deploy(admin_pb2.DeployRequest(ref="trt_llama:1"), metadata=ACTOR, timeout=60)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'tensorrtllm' backend with 2 GPU(s)" in caught.value.details()


def _sha256(path: Path) -> str:
    from server.control.registry.artifacts import sha256_file

    return sha256_file(path)
