"""The fuzz step's stack: the demo models, the MiniLM embeddings and tiny_llama behind one
frontend and one Triton (one start for the whole step), and what it looked like before the fuzz."""

from __future__ import annotations

import pytest

from tests.conftest import start_stack, stop_stack
from tests.stack_health import baseline, metrics_text, samples


@pytest.fixture(scope="session")
def fuzz_repository(tmp_path_factory):
    from model_repository.demo import build_demo_repository
    from model_repository.embeddings import build_embedding_model
    from server.control.rollout.llm_install import install_llm_models

    out = tmp_path_factory.mktemp("fuzz") / "model_repository"
    build_demo_repository(out)
    build_embedding_model(out)
    install_llm_models(out, tiny=True)  # registered in a scratch registry beside the repository, deployed from it
    return out


@pytest.fixture(scope="session")
def fuzz_stack(fuzz_repository, tmp_path_factory):
    s = start_stack(fuzz_repository, tmp_path_factory.mktemp("fuzz_stack"))
    s.before = baseline(s)
    s.series_before = len(samples(metrics_text(s)))
    s.unknown_names = set()  # made-up model names the fuzz sent (each carries strategies.MARKER)
    s.outcomes = {}  # test -> status -> count
    yield s
    stop_stack(s)
