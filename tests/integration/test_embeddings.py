"""Embeddings through the bridge: the openai SDK against MiniLM served by Triton (ONNX, dynamic
batching), checked against the model evaluated directly in PyTorch."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

pytestmark = pytest.mark.integration
import openai  # noqa: E402

MODEL = "minilm_embeddings"


@pytest.fixture(scope="module")
def client(llm_stack):
    c = openai.OpenAI(base_url=f"http://{llm_stack.http}/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def test_embeddings_match_the_model_evaluated_directly(client):
    from model_repository.embeddings import SAMPLE_TEXTS, reference_embeddings

    r = client.embeddings.create(model=MODEL, input=list(SAMPLE_TEXTS))
    served = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert [d.index for d in r.data] == list(range(len(SAMPLE_TEXTS)))
    assert served.shape == (len(SAMPLE_TEXTS), 384)
    assert np.allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-4)
    expected = reference_embeddings(SAMPLE_TEXTS)
    cosine = (served * expected).sum(axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.999, cosine
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(SAMPLE_TEXTS)


def test_single_string_and_base64(client):
    one = client.embeddings.create(model=MODEL, input="hello")
    b64 = client.embeddings.create(model=MODEL, input="hello", encoding_format="base64")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    assert np.allclose(decoded, np.array(one.data[0].embedding, dtype=np.float32), atol=1e-6)


def test_concurrent_requests_batch_and_stay_separate(llm_stack):
    texts = [f"sentence number {i} about serving" for i in range(24)]

    async def many():
        aclient = openai.AsyncOpenAI(base_url=f"http://{llm_stack.http}/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(aclient.embeddings.create(model=MODEL, input=t) for t in texts))
        finally:
            await aclient.close()

    singles = np.array([r.data[0].embedding for r in asyncio.run(many())], dtype=np.float32)
    client = openai.OpenAI(base_url=f"http://{llm_stack.http}/v1", api_key="unused", max_retries=0)
    together = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data], dtype=np.float32)
    assert np.allclose(singles, together, atol=1e-4)  # padding in a batch does not change a row


def test_bad_inputs(client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[[1, 2, 3]])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="tiny_llama", input="x")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no_such_model", input="x")
