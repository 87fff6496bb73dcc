"""Every kind of request goes through the one admission pipeline, on the real stack with auth on:
a ModelInfer, a REST v2 infer, a ModelStreamInfer message, an OpenAI chat completion, OpenAI
embeddings and a gRPC Generate are each counted (``inferplane_requests_total``), metered (a usage
row of the tenant) and taken by the model's fair queue (``inferplane_admissions_total``). The LLM
path is fair-queued like the rest: more concurrent generations than the engine's slots wait in the
frontend's queue and all finish."""

from __future__ import annotations

import concurrent.futures
import json
import queue
import re
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from model_repository.config_writer import read_config, write_config
from server.protogen.inferplane.v1 import generate_pb2, generate_pb2_grpc
from server.tenancy.store import TenancyStore
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration
import openai  # noqa: E402

PEPPER = "one-pipeline-pepper"
LLM = "tiny_llama"
NARROW = "tiny_llama_narrow"  # a copy whose engine runs 2 sequences at once: the frontend queues the rest
EMBEDDINGS = "minilm_embeddings"


@pytest.fixture(scope="module")
def pipeline_stack(llm_repository, tmp_path_factory):
    import shutil

    workdir = tmp_path_factory.mktemp("one_pipeline")
    repository = workdir / "model_repository"
    shutil.copytree(llm_repository, repository, ignore=shutil.ignore_patterns("tiny_llama_budget", "smollm2*"))
    shutil.copytree(repository / LLM, repository / NARROW)
    config = read_config(repository / NARROW)
    config.name = NARROW
    config.parameters["max_running"].string_value = "2"
    write_config(config, repository / NARROW)
    url = f"sqlite:///{workdir}/tenancy.db"
    store = TenancyStore(url)
    keys = {t: store.create_key(t, PEPPER.encode(), team=f"team-{t}", models=[LLM, NARROW, EMBEDDINGS])[1] for t in ("every", "many")}
    env = {"INFERPLANE_DATABASE_URL": url, "INFERPLANE_KEY_PEPPER": PEPPER, "INFERPLANE_USAGE_FLUSH_S": "0.3", "INFERPLANE_AUTH": "on"}
    stack = start_stack(repository, workdir, "--model", LLM, "--model", NARROW, "--model", EMBEDDINGS, env=env)
    stack.keys, stack.store = keys, store
    yield stack
    stop_stack(stack)
    store.close()


def _metrics(stack) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{stack.metrics}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)\{([^}]*)\} (\S+)$", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2))))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def _sum(metrics, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def _usage_by_model(stack, tenant: str) -> dict[str, int]:
    return {r["model"]: r["requests"] for r in stack.store.usage("tenant_model") if r["tenant"] == tenant}


def _bytes_input(name: str, value: str, client=grpcclient):
    tensor = client.InferInput(name, [1, 1] if name == "text" else [1], "BYTES")
    tensor.set_data_from_numpy(np.array([[value.encode()]] if name == "text" else [value.encode()], dtype=np.object_))
    return tensor


def test_each_transport_and_kind_is_counted_metered_and_fair_queued(pipeline_stack):
    stack = pipeline_stack
    key = stack.keys["every"]
    bearer = {"authorization": f"Bearer {key}"}
    before = _metrics(stack)

    # 1. ModelInfer over gRPC (tritonclient), 2. REST v2 infer (tritonclient.http): the embedding model
    grpc_client = grpcclient.InferenceServerClient(stack.grpc)
    assert grpc_client.infer(EMBEDDINGS, [_bytes_input("text", "one")], headers=bearer).as_numpy("embedding").shape == (1, 384)
    http_client = httpclient.InferenceServerClient(stack.http)
    assert http_client.infer(EMBEDDINGS, [_bytes_input("text", "two", httpclient)], headers=dict(bearer))  # it adds its own headers to the dict.as_numpy("embedding").shape == (1, 384)
    # 3. a ModelStreamInfer message to the LLM
    results: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: results.put((result, error)), headers=bearer)
    grpc_client.async_stream_infer(LLM, [_bytes_input("text_input", "hi"), _bytes_input("parameters", json.dumps({"max_tokens": 3, "ignore_eos": True}))], request_id="s1")
    while True:
        result, error = results.get(timeout=60)
        assert error is None, error
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    grpc_client.stop_stream()
    grpc_client.close()
    # 4. OpenAI chat completions, 5. OpenAI embeddings
    client = openai.OpenAI(base_url=f"http://{stack.http}/v1", api_key=key, max_retries=0, timeout=60)
    try:
        chat = client.chat.completions.create(model=LLM, messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        assert len(client.embeddings.create(model=EMBEDDINGS, input="three").data) == 1
    finally:
        client.close()
    # 6. gRPC Generate
    with grpc.insecure_channel(stack.grpc) as channel:
        request = generate_pb2.GenerateRequest(model=LLM, prompt="once", max_tokens=2, ignore_eos=True)
        responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=tuple(bearer.items()), timeout=60))
    assert responses[-1].usage.completion_tokens == 2

    after = _metrics(stack)
    delta = lambda name, **labels: _sum(after, name, **labels) - _sum(before, name, **labels)  # noqa: E731
    # counted: three embedding calls and three generations, all OK
    assert delta("inferplane_requests_total", model=EMBEDDINGS, code="OK") == 3
    assert delta("inferplane_requests_total", model=LLM, code="OK") == 3
    # fair-queued: each one was taken by its model's queue (a free slot here)
    assert delta("inferplane_admissions_total", model=EMBEDDINGS) == 3
    assert delta("inferplane_admissions_total", model=LLM) == 3
    # metered: one usage row per request, per model
    def metered():
        usage = _usage_by_model(stack, "every")
        return usage if usage.get(EMBEDDINGS, 0) >= 3 and usage.get(LLM, 0) >= 3 else None

    wait_until(metered, timeout=30)
    assert _usage_by_model(stack, "every") == {EMBEDDINGS: 3, LLM: 3}


def test_generations_beyond_the_engines_slots_wait_in_the_fair_queue_and_all_finish(pipeline_stack):
    stack = pipeline_stack
    client = openai.OpenAI(base_url=f"http://{stack.http}/v1", api_key=stack.keys["many"], max_retries=0, timeout=120)
    before = _metrics(stack)

    def ask(i: int) -> int:
        answer = client.chat.completions.create(model=NARROW, messages=[{"role": "user", "content": f"n{i}"}], max_tokens=24, extra_body={"ignore_eos": True})
        return answer.usage.completion_tokens

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            tokens = list(pool.map(ask, range(6)))  # 2 running + 4 waiting: the queue holds two rounds of slots
    finally:
        client.close()
    assert tokens == [24] * 6
    after = _metrics(stack)
    queued = _sum(after, "inferplane_admissions_total", model=NARROW, path="queued") - _sum(before, "inferplane_admissions_total", model=NARROW, path="queued")
    direct = _sum(after, "inferplane_admissions_total", model=NARROW, path="direct") - _sum(before, "inferplane_admissions_total", model=NARROW, path="direct")
    assert queued + direct == 6 and queued >= 1  # 2 slots, 6 at once: the rest waited in the frontend
    assert _sum(after, "inferplane_queue_depth", model=NARROW) == 0
