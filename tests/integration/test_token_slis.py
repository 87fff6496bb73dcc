"""Token-level SLIs on the real stack (issue 31): one streamed generation through the openai SDK, the
REST bridge and a real Triton running the CPU engine on the tiny random Llama, then the frontend's
/metrics holds its time to first token, inter-token latency and tokens per second series. A stack
of its own with only tiny_llama (the shared llm_stack also builds SmolLM2 and trains its LoRA pair)."""

from __future__ import annotations

import re
import urllib.request

import pytest

from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")

MODEL = "tiny_llama"


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory):
    from server.control.rollout.llm_install import install_llm_models

    root = tmp_path_factory.mktemp("token_slis")
    install_llm_models(root / "model_repository", tiny=True, work=root)  # registered in a scratch registry beside it, deployed from there
    stack = start_stack(root / "model_repository", root / "stack")
    yield stack
    stop_stack(stack)


def _series(text: str, name: str) -> float:
    """One series' value (the exposition sorts labels: model, tenant, version)."""
    match = re.search(rf'^{name}{{model="{MODEL}",tenant="[^"]+",version="1"}} ([0-9.e+-]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_generation_exports_its_token_slis(tiny_stack):
    def scrape() -> str:
        return urllib.request.urlopen(f"http://{tiny_stack.metrics}/metrics", timeout=10).read().decode()

    client = openai.OpenAI(base_url=f"http://{tiny_stack.http}/v1", api_key="unused", max_retries=0, timeout=120)
    before = scrape()
    try:
        reasons = []
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                    max_tokens=8, temperature=0, seed=3, stream=True):  # fmt: skip
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason is not None]
    finally:
        client.close()
    assert reasons == ["length"]
    after = scrape()
    for name in ("inferplane_time_to_first_token_seconds_count", "inferplane_generation_tokens_per_second_count"):
        assert _series(after, name) == _series(before, name) + 1, name
    assert _series(after, "inferplane_inter_token_latency_seconds_count") > _series(before, "inferplane_inter_token_latency_seconds_count")
    assert _series(after, "inferplane_time_to_first_token_seconds_sum") > _series(before, "inferplane_time_to_first_token_seconds_sum")
    assert re.search(rf'inferplane_time_to_first_token_seconds_bucket{{le="0.5",model="{MODEL}",tenant="[^"]+",version="1"}}', after)
