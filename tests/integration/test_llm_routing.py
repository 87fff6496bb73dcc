"""LLM routing across two local Triton replicas of the tiny random Llama (our CPU engine, prefix
cache on): requests that share a long system prompt go to one replica and hit its prefix cache; a
third stream held open at once passes the load bound and spills to the other replica. The stack's
default policy is round robin and the endpoint's config names ``inferplane.routing: prefix_aware``,
so these pass only if the endpoint's own policy wins (round robin's behaviour is unit-tested, and
compared in ``python -m loadtest.llm_routing``; one model keeps this stack to one model load).
Checked with the openai SDK against the frontend and against each replica's own engine (its
``stats`` command on its own port)."""

from __future__ import annotations

import pytest

from loadtest.llm_routing import engine_stats, replica_targets
from tests.conftest import start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration
import openai  # noqa: E402

MODEL = "tiny_llama"
SYSTEM = (
    "You are the help desk of the Northwind bicycle shop. Answer in one short sentence, name the part "
    "number when you know it, never promise delivery dates, and send warranty questions to the service desk. "
) * 4  # ~800 characters (~500 tokens of this tokenizer): past the routing key's 512 and many 16-token prefix blocks


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    from model_repository.config_writer import read_config, write_config
    from server.control.rollout.llm_install import install_llm_models

    root = tmp_path_factory.mktemp("llm_routing")
    repository = root / "model_repository"
    install_llm_models(repository, tiny=True, work=root)  # registered in a scratch registry beside it, deployed from there
    config = read_config(repository / MODEL)
    config.parameters["inferplane.routing"].string_value = "prefix_aware"
    write_config(config, repository / MODEL)
    env = {"INFERPLANE_LOCAL_REPLICAS": "2", "INFERPLANE_REPLICA_HEALTH_INTERVAL_S": "0.2", "INFERPLANE_LLM_ROUTING": "round_robin"}
    stack = start_stack(repository, root / "stack", env=env)
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def client(routed):
    c = openai.OpenAI(base_url=f"http://{routed.http}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def replicas(stack, model: str) -> list[str]:
    """The targets of the local replicas hosting ``model`` (the executor's view): two, fixed."""
    return replica_targets(stack.grpc, model, 2)


def submitted(targets: list[str], model: str) -> list[int]:
    return [engine_stats(t, model)["submitted"] for t in targets]


def ask(client, model: str, user: str, **kwargs):
    return client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], max_tokens=4, temperature=0, **kwargs
    )


def test_two_replicas_serve_the_model(routed):
    def two():
        targets = replicas(routed, MODEL)
        return targets if len(set(targets)) == 2 else None

    targets = wait_until(two, timeout=60, explain=lambda: replicas(routed, MODEL))
    # each one's own engine answers for the model (its counters, on its own Triton)
    assert all("submitted" in engine_stats(t, MODEL) for t in targets)


def test_a_shared_system_prompt_stays_on_one_replica_and_hits_its_prefix_cache(routed, client):
    targets = replicas(routed, MODEL)
    before = submitted(targets, MODEL)
    hits_before = [engine_stats(t, MODEL)["prefix_hit_tokens"] for t in targets]
    answers = [ask(client, MODEL, f"Question {i}: do you sell {part}?") for i, part in enumerate(["tyres", "chains", "bells", "lamps", "locks"])]
    grew = [a - b for a, b in zip(submitted(targets, MODEL), before)]
    assert sorted(grew) == [0, 5]  # every one on the same replica
    home = grew.index(5)
    assert all(a.usage.prompt_tokens_details.cached_tokens > 0 for a in answers[1:])  # the shared prompt's blocks were cached
    assert answers[0].usage.prompt_tokens_details.cached_tokens < answers[1].usage.prompt_tokens_details.cached_tokens
    hits = [engine_stats(t, MODEL)["prefix_hit_tokens"] - h for t, h in zip(targets, hits_before)]
    assert hits[home] >= 4 * 16 and hits[1 - home] == 0


def test_past_the_load_bound_a_stream_spills_to_the_other_replica(routed, client):
    targets = replicas(routed, MODEL)
    before = submitted(targets, MODEL)
    # three long generations held open together: with two replicas the bound is 1.25 x 3/2 + 1 = 2.875
    # streams, so the first two stay with the prompt's replica and the third goes to the other one
    streams = []
    try:
        for i in range(3):
            stream = ask(client, MODEL, f"Tell me a long story {i}", stream=True, extra_body={"ignore_eos": True, "max_tokens": 1400})
            next(iter(stream))  # the engine started it (it is in flight on its replica)
            streams.append(stream)
        grew = [a - b for a, b in zip(submitted(targets, MODEL), before)]
    finally:
        for stream in streams:
            stream.close()
    assert sorted(grew) == [1, 2]
    # once they are gone the prompt's replica takes it again, from its cache
    wait_until(lambda: all(engine_stats(t, MODEL)["running"] == 0 for t in targets), timeout=60)
    home = grew.index(2)
    again = submitted(targets, MODEL)
    answer = ask(client, MODEL, "One more question")
    assert [a - b for a, b in zip(submitted(targets, MODEL), again)] == [1 - home, home] and answer.usage.prompt_tokens_details.cached_tokens > 0

