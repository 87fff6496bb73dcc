"""The composite-endpoint and batch stack: the demo composites (and their members, MiniLM, the
tabular demos) compiled into one repository, served by one real stack for the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import copy_demo_models, start_stack


@pytest.fixture(scope="session")
def compose_repository(demo_repository, tmp_path_factory) -> Path:
    from model_repository.embeddings import build_embedding_model
    from server.cli.compose import build_demo_composites

    out = copy_demo_models(demo_repository, tmp_path_factory.mktemp("compose") / "model_repository")
    build_embedding_model(out)
    build_demo_composites(out, text=True)
    return out


@pytest.fixture(scope="session")
def compose_stack(compose_repository, tmp_path_factory, session_stacks):
    workdir = tmp_path_factory.mktemp("compose_stack")
    s = start_stack(compose_repository, workdir, env={"INFERPLANE_ROLLBACK_GRACE_S": "600", "INFERPLANE_BATCH_LEASE_S": "3"})
    s.workdir = workdir
    yield s
    session_stacks.append(s)
