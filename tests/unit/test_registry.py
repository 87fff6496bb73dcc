"""The registry on SQLite always, and on a real PostgreSQL server when one is available.

The PostgreSQL server is the one `make provision` sets up (or ``INFERPLANE_TEST_POSTGRES_URL``: a role
allowed to create databases); each test gets a database of its own. Without one the postgresql
parameter fails with the reason (tests/services.py).
"""

from __future__ import annotations

import io
import pickle
import uuid

import numpy as np
import pytest

from server.control.registry.artifacts import ArtifactStore, ArtifactTampered, sha256_bytes
from server.errors import Conflict, InvalidRequest, ModelNotFound, PermissionDenied
from server.control.registry.registry import Registry, parse_ref
from server.control.registry.safe_formats import UnsafeArtifact
from server.control.registry.signing import generate_keypair, sign_digest
from tests.conftest import fresh_postgres_database

SIGNATURE = {
    "inputs": [{"name": "features", "datatype": "FP32", "dims": [3], "range": [-1, 1]}],
    "outputs": [{"name": "prediction", "datatype": "FP32", "dims": [1]}],
}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.service("postgresql"))])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/registry.db"
        return
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def registry(db_url, tmp_path):
    reg = Registry(db_url, ArtifactStore(tmp_path / "artifacts"))
    yield reg
    reg.close()


def lightgbm(rounds: int = 2, seed: int = 0) -> bytes:
    import lightgbm as lgb

    rng = np.random.default_rng(seed)
    params = {"objective": "regression", "num_threads": 1, "verbose": -1, "min_data_in_leaf": 2, "seed": seed}
    return lgb.train(params, lgb.Dataset(rng.random((40, 3)), label=rng.random(40)), rounds).model_to_string().encode()


def npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_register_is_versioned_content_addressed_and_idempotent(registry):
    a, b = lightgbm(2), lightgbm(3)
    v1, created = registry.register(
        "m", a, signature=SIGNATURE, filename="model.txt", metrics={"rmse": 0.5}, tags={"stage": "dev"},
        hardware={"gpu": 0, "memory_mb": 256}, training_run="run-1", dataset_version="ds-1", owner_team="fraud",
        validation=npz(features=np.zeros((2, 3), np.float32)), actor="alice",
    )  # fmt: skip
    assert created and v1.version == 1 and v1.sha256 == sha256_bytes(a) and v1.format == "lightgbm-text"
    assert v1.size_bytes == len(a) and v1.metrics == {"rmse": 0.5} and v1.hardware == {"gpu": 0, "memory_mb": 256}
    assert v1.signature["inputs"][0]["range"] == [-1.0, 1.0] and v1.owner_team == "fraud"
    assert registry.store.get(v1.sha256) == a

    again, created = registry.register("m", a, signature=SIGNATURE, metrics={"rmse": 0.1}, training_run="other")
    assert not created and again == v1  # same version, and a version never changes
    # ...so the same bytes asking to be served on other hardware are refused, not answered with v1's metadata
    with pytest.raises(Conflict, match="already holds these bytes as version 1"):
        registry.register("m", a, signature=SIGNATURE, hardware={"gpu": 1, "memory_mb": 256})
    same, created = registry.register("m", a, signature=SIGNATURE, hardware={"gpu": 0, "memory_mb": 256})
    assert not created and same == v1

    v2, created = registry.register("m", b, signature=SIGNATURE, parent="m:1")
    assert created and v2.version == 2 and v2.parent == "m:1"
    assert [r.version for r in registry.list_versions("m")] == [1, 2]
    assert registry.get("m").version == 2 and registry.get("m", 1) == v1
    assert registry.list_models()[0].latest_version == 2
    # the same bytes under another name are another model's version 1
    other, created = registry.register("n", a, signature=SIGNATURE)
    assert created and other.version == 1


def test_lineage_follows_parents_across_models(registry):
    registry.register("base", lightgbm(2), signature=SIGNATURE, training_run="run-7", dataset_version="ds-3", experiment="exp")
    registry.register("base", lightgbm(3), signature=SIGNATURE, parent="1")
    registry.register("distilled", lightgbm(4), signature=SIGNATURE, parent="base:2")
    chain = registry.lineage("distilled")
    assert [r.ref for r in chain] == ["distilled:1", "base:2", "base:1"]
    assert chain[-1].training_run == "run-7" and chain[-1].dataset_version == "ds-3"
    with pytest.raises(ModelNotFound):
        registry.register("x", lightgbm(5), signature=SIGNATURE, parent="base:9")


def test_pickles_are_refused_audited_and_never_stored(registry, tmp_path):
    with pytest.raises(UnsafeArtifact, match="ONNX"):
        registry.register("m", pickle.dumps({"w": 1}), signature=SIGNATURE, filename="model.joblib", actor="mallory")
    assert not list((tmp_path / "artifacts").rglob("*")) or not any(p.is_file() for p in (tmp_path / "artifacts").rglob("*"))
    entry = registry.audit_log(5)[0]
    assert (entry.actor, entry.action, entry.outcome) == ("mallory", "register", "refused")
    with pytest.raises(ModelNotFound):
        registry.get("m")
    with pytest.raises(InvalidRequest, match="without pickles"):
        registry.register("m", lightgbm(), signature=SIGNATURE, validation=npz(features=np.array([{"a": 1}], dtype=object)))


@pytest.mark.parametrize(
    ("signature", "match"),
    [
        ({"inputs": []}, "non-empty 'inputs'"),
        ({"inputs": [{"name": "x", "dims": [2]}], "outputs": [{"name": "y", "datatype": "FP99", "dims": [1]}]}, "datatype"),
        ({"inputs": [{"name": "x", "dims": [0]}], "outputs": [{"name": "y", "dims": [1]}]}, "dims"),
        ({"inputs": [{"name": "x", "dims": [2], "range": [3, 1]}], "outputs": [{"name": "y", "dims": [1]}]}, "empty"),
    ],
)
def test_signatures_are_checked(registry, signature, match):
    with pytest.raises(InvalidRequest, match=match):
        registry.register("m", lightgbm(), signature=signature)


def test_refs_are_checked():
    assert parse_ref("fraud_xgboost:12") == ("fraud_xgboost", 12)
    assert parse_ref("m") == ("m", None)
    for bad in ("../etc", "m:0", "m:x", ""):
        with pytest.raises(InvalidRequest):
            parse_ref(bad)


def test_signed_artifacts_when_the_team_requires_them(registry):
    private, public = generate_keypair()
    other_private, _ = generate_keypair()
    registry.trust_key("fraud", public.decode(), actor="admin")
    registry.set_require_signed("fraud", True, actor="admin")
    data = lightgbm(2)
    with pytest.raises(PermissionDenied, match="requires signed"):
        registry.register("m", data, signature=SIGNATURE, owner_team="fraud")
    with pytest.raises(PermissionDenied, match="does not verify"):
        registry.register("m", data, signature=SIGNATURE, owner_team="fraud", artifact_signature=sign_digest(other_private, sha256_bytes(data)))
    record, _ = registry.register("m", data, signature=SIGNATURE, owner_team="fraud", artifact_signature=sign_digest(private, sha256_bytes(data)))
    assert record.signing_key_id
    registry.verify_signed("m", 1)  # checked again at deploy time
    registry.set_require_signed("fraud", False)
    unsigned, _ = registry.register("m", lightgbm(3), signature=SIGNATURE)  # the model's team is kept
    assert unsigned.owner_team == "fraud" and unsigned.signing_key_id is None
    registry.set_require_signed("fraud", True)
    with pytest.raises(PermissionDenied):
        registry.verify_signed("m", 2)
    with pytest.raises(Conflict, match="belongs to team 'fraud'"):
        registry.register("m", lightgbm(4), signature=SIGNATURE, owner_team="growth")


def test_deployments_are_a_stack(registry):
    for rounds in (2, 3, 4):
        registry.register("m", lightgbm(rounds), signature=SIGNATURE)
    for version in (1, 2, 3):
        registry.record_deployment("m", "m", version, {"instances": 1}, "alice")
    ep = registry.endpoint("m")
    assert (ep.live, ep.previous, len(ep.history)) == (3, 2, 3)
    registry.record_rollback("m")
    assert (registry.endpoint("m").live, registry.endpoint("m").previous) == (2, 1)
    registry.record_rollback("m")
    assert (registry.endpoint("m").live, registry.endpoint("m").previous) == (1, None)
    with pytest.raises(Conflict, match="no previous version"):
        registry.record_rollback("m")
    assert [e.name for e in registry.endpoints()] == ["m"]
    with pytest.raises(ModelNotFound):
        registry.endpoint("nope")


def test_the_store_refuses_tampered_blobs(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    digest = store.put(b"model bytes")
    assert store.put(b"model bytes") == digest and store.get(digest) == b"model bytes"
    path = tmp_path / "store" / "sha256" / digest[:2] / digest
    path.write_bytes(b"evil bytes!")
    with pytest.raises(ArtifactTampered, match="tampered"):
        store.get(digest)
    store.put(b"model bytes")  # registering the real bytes again heals the blob
    assert store.get(digest) == b"model bytes"
    with pytest.raises(ModelNotFound):
        store.get("0" * 64)


def test_any_fsspec_url_is_a_store():
    store = ArtifactStore(f"memory://inferplane-{uuid.uuid4().hex}")
    digest = store.put(b"abc")
    assert store.exists(digest) and store.get(digest) == b"abc"


def _safetensors(fill: int = 0) -> bytes:
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes([fill]) * 16


def test_an_llms_companions_are_part_of_its_version_digest(registry):
    from server.control.registry.artifacts import content_digest
    from server.control.registry.registry import LLM_SIGNATURE

    weights, config = _safetensors(), b'{"architectures": ["LlamaForCausalLM"]}'
    first, created = registry.register("chat", weights, companions={"config.json": config, "tokenizer.json": b'{"v": 1}'})
    assert created and first.signature["outputs"] == LLM_SIGNATURE["outputs"]  # an LLM speaks the engine's tensors
    assert first.content_sha256 == content_digest(sha256_bytes(weights), {"config.json": sha256_bytes(config), "tokenizer.json": sha256_bytes(b'{"v": 1}')})
    assert first.content_sha256 != first.sha256
    again, created = registry.register("chat", weights, companions={"tokenizer.json": b'{"v": 1}', "config.json": config})
    assert (again.version, created) == (1, False)  # the same files: the same version
    other, created = registry.register("chat", weights, companions={"config.json": config, "tokenizer.json": b'{"v": 2}'})
    assert created and other.version == 2 and other.sha256 == first.sha256  # the same weights, another tokenizer
    bare, created = registry.register("chat", weights)
    assert created and bare.version == 3 and bare.content_sha256 == bare.sha256  # without companions: the artifact's digest
    with pytest.raises(InvalidRequest, match="needs a signature"):
        registry.register("scores", lightgbm())


def test_a_signed_llm_signs_its_content_digest(registry):
    private, public = generate_keypair()
    registry.trust_key("nlp", public.decode())
    registry.set_require_signed("nlp", True)
    weights, companions = _safetensors(1), {"config.json": b"{}"}
    from server.control.registry.artifacts import content_digest

    with pytest.raises(PermissionDenied):  # the weights' digest alone does not cover the config
        registry.register("signed_chat", weights, companions=companions, owner_team="nlp", artifact_signature=sign_digest(private, sha256_bytes(weights)))
    digest = content_digest(sha256_bytes(weights), {"config.json": sha256_bytes(b"{}")})
    record, created = registry.register("signed_chat", weights, companions=companions, owner_team="nlp", artifact_signature=sign_digest(private, digest))
    assert created and record.signing_key_id
    registry.verify_signed("signed_chat", 1)


def test_a_chat_template_and_a_text_vocabulary_are_companions_a_pickle_named_txt_is_not(registry):
    template = b"{% for message in messages %}{{ message['content'] }}{% endfor %}"
    record, _ = registry.register("chat", _safetensors(), companions={"config.json": b"{}", "chat_template.jinja": template, "merges.txt": b"a b\n"})
    assert sorted(record.companions) == ["chat_template.jinja", "config.json", "merges.txt"]
    assert registry.store.get(record.companions["chat_template.jinja"]) == template
    with pytest.raises(UnsafeArtifact, match="plain text"):
        registry.register("chat", _safetensors(2), companions={"vocab.txt": pickle.dumps({"a": 1})})
