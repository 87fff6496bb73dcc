"""Typed messages <-> tensors (server.transports.typed.codec): the canonical-bytes hot path agrees
with the message path, every bad input names its field, answers encode the same both ways; and
the schema catalog's deploy / retire bookkeeping on a real SQLite registry."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from server.control.typed import typed_schema as ts
from server.control.typed.declared_signature import check_signature
from server.errors import Conflict, InvalidRequest, ModelNotFound
from server.protogen.inference import grpc_service_pb2 as pb
from server.transports.typed.codec import Codec
from server.transports.typed.service import build
from tests.unit.test_typed_schema import FRAUD

NAMES = [f"f{i}" for i in range(20)]  # fields 16+ take two tag bytes
TABULAR = {
    "inputs": [{"name": "features", "datatype": "FP32", "dims": [20], "features": [{"name": n, "range": [-5, 5]} for n in NAMES]}],
    "outputs": [{"name": "probability", "datatype": "FP32", "dims": [1]}, {"name": "scores", "datatype": "FP32", "dims": [3]}],
}


def codec(signature=TABULAR, name="fraud") -> Codec:
    return build(ts.from_signature(name, check_signature(signature)))[1]


def _row(c: Codec, values, cls=None):
    cls = cls or c.Request
    return cls(**dict(zip(NAMES, map(float, values))))


def test_canonical_bytes_take_the_fixed_layout_and_agree_with_the_message_path():
    c = codec()
    assert c.wire is not None and c.answers is not None
    rng = np.random.default_rng(0)
    rows = rng.uniform(-5, 5, size=(7, 20)).astype(np.float32)
    raw = _row(c, rows[0]).SerializeToString()
    fast = c.wire.row(raw)
    assert fast is not None and fast.dtype == np.float32
    np.testing.assert_array_equal(fast, rows[:1])
    (slow,) = c.read([c.Request.FromString(raw)])
    np.testing.assert_array_equal(slow, rows[:1])
    batch = c.BatchRequest(rows=[_row(c, r, c.Row) for r in rows]).SerializeToString()
    fast_rows = c.wire.rows(batch)
    assert fast_rows is not None and fast_rows.shape == (7, 20)
    np.testing.assert_array_equal(fast_rows, rows)
    arrays, n = c.decode(batch, batch=True)
    assert n == 7
    np.testing.assert_array_equal(arrays[0], rows)
    # the same values in another field order: not the fixed layout, the same row
    reordered = b"".join(c.Request(**{name: float(rows[0][i])}).SerializeToString() for i, name in reversed(list(enumerate(NAMES))))
    assert c.wire.row(reordered) is None
    arrays, _ = c.decode(reordered, batch=False)
    np.testing.assert_array_equal(arrays[0], rows[:1])


def test_the_model_request_carries_the_rows_as_raw_tensors():
    c = codec()
    rows = np.arange(40, dtype=np.float32).reshape(2, 20) / 10
    arrays, n = c.decode(c.BatchRequest(rows=[_row(c, r, c.Row) for r in rows]).SerializeToString(), batch=True)
    request = c.infer_request(arrays, batched=True)
    assert request.model_name == "fraud" and request.inputs[0].name == "features" and list(request.inputs[0].shape) == [2, 20]
    np.testing.assert_array_equal(np.frombuffer(request.raw_input_contents[0], np.float32).reshape(2, 20), rows)
    unbatched = c.infer_request(arrays[:1] and [arrays[0][:1]], batched=False)
    assert list(unbatched.inputs[0].shape) == [20]


def _violations(err: InvalidRequest) -> dict[str, str]:
    return {v.field: v.description for v in err.violations}


def test_missing_wrong_type_and_out_of_range_fields_are_named():
    c = codec()
    good = dict(zip(NAMES, [0.5] * 20))
    missing = c.Request(**{k: v for k, v in good.items() if k != "f3"}).SerializeToString()
    with pytest.raises(InvalidRequest) as err:
        c.decode(missing, batch=False)
    assert _violations(err.value) == {"f3": "required field is missing (float = 4)"}
    # f17 (field 18) sent as a varint (an int field of another schema), not a float
    wrong = c.Request(**{k: v for k, v in good.items() if k != "f17"}).SerializeToString() + bytes([0x90, 0x01, 0x07])
    with pytest.raises(InvalidRequest) as err:
        c.decode(wrong, batch=False)
    assert "wrong type: got a varint" in _violations(err.value)["f17"]
    for value in (7.5, float("nan"), float("inf")):
        with pytest.raises(InvalidRequest) as err:
            c.decode(c.Request(**dict(good, f0=value)).SerializeToString(), batch=False)
        assert "outside the declared range [-5, 5]" in _violations(err.value)["f0"]
    rows = [c.Row(**good), c.Row(**dict(good, f19=-9.0)), c.Row(**{k: v for k, v in good.items() if k != "f1"})]
    with pytest.raises(InvalidRequest) as err:
        c.decode(c.BatchRequest(rows=rows).SerializeToString(), batch=True)
    assert set(_violations(err.value)) == {"rows[1].f19", "rows[2].f1"}
    with pytest.raises(InvalidRequest, match="at least one row"):
        c.decode(b"", batch=True)
    with pytest.raises(InvalidRequest, match="not a valid"):
        c.decode(b"\xff\xff\xff", batch=False)


def test_enums_map_labels_to_tensor_values_and_refuse_others():
    c = codec(FRAUD)
    assert c.wire is None  # an enum field is a varint: the message path
    cat = c.Request.DESCRIPTOR.fields_by_name["merchant_category"].enum_type.values_by_name
    ok = c.Request(amount=12.5, merchant_category=cat["MERCHANT_CATEGORY_ELECTRONICS"].number, hour_of_day=3, card_age_days=400)
    arrays, _ = c.decode(ok.SerializeToString(), batch=False)
    np.testing.assert_array_equal(arrays[0], np.array([[12.5, 2.0, 3.0, 400.0]], np.float32))  # ELECTRONICS is tensor value 2
    for number, says in ((0, "UNSPECIFIED (0) is not a declared value"), (9, "9 is not a declared value of MerchantCategory")):
        bad = c.Request(amount=1, merchant_category=number, hour_of_day=3, card_age_days=1)
        with pytest.raises(InvalidRequest) as err:
            c.decode(bad.SerializeToString(), batch=False)
        assert says in _violations(err.value)["merchant_category"]
    with pytest.raises(InvalidRequest) as err:
        c.decode(c.Request(amount=1, merchant_category=1, hour_of_day=25, card_age_days=1).SerializeToString(), batch=False)
    assert _violations(err.value) == {"hour_of_day": "25 is outside the declared range [0, 23]"}


def test_integer_widths_text_and_tensor_fields():
    signature = {
        "inputs": [
            {"name": "counts", "datatype": "INT8", "dims": [2], "features": ["clicks", "views"]},
            {"name": "text", "datatype": "BYTES", "dims": [1]},
            {"name": "weights", "datatype": "FP32", "dims": [3]},
        ],
        "outputs": [{"name": "label", "datatype": "BYTES", "dims": [1]}, {"name": "tokens", "datatype": "INT32", "dims": [1]}],
    }
    c = codec(signature, "mixed")
    ok = c.Request(clicks=-3, views=100, text="héllo", weights=[1, 2, 3])
    counts, text, weights = c.decode(ok.SerializeToString(), batch=False)[0]
    assert counts.dtype == np.int8 and counts.tolist() == [[-3, 100]]
    assert text.tolist() == [[b"h\xc3\xa9llo"]] and weights.tolist() == [[1.0, 2.0, 3.0]]
    request = c.infer_request([counts, text, weights], batched=True)
    assert [t.datatype for t in request.inputs] == ["INT8", "BYTES", "FP32"]
    with pytest.raises(InvalidRequest) as err:
        c.decode(c.Request(clicks=300, views=1, text="x", weights=[1, 2, 3]).SerializeToString(), batch=False)
    assert _violations(err.value) == {"clicks": "300 does not fit INT8 [-128, 127]"}
    with pytest.raises(InvalidRequest) as err:
        c.decode(c.Request(clicks=1, views=1, weights=[1, 2]).SerializeToString(), batch=False)
    assert set(_violations(err.value)) == {"text", "weights"} and "expected 3 values" in _violations(err.value)["weights"]
    # answers: text and ints through the message class
    answer = pb.ModelInferResponse()
    for name, datatype, data in (("label", "BYTES", b"\x03\x00\x00\x00cat\x03\x00\x00\x00dog"), ("tokens", "INT32", np.array([[5], [7]], np.int32).tobytes())):
        answer.outputs.add(name=name, datatype=datatype, shape=[2, 1])
        answer.raw_output_contents.append(data)
    out = c.BatchResponse.FromString(c.encode(answer, 2, batch=True, batched=True))
    assert [(r.label, r.tokens) for r in out.results] == [("cat", 5), ("dog", 7)]


def test_float_answers_encode_the_same_as_the_message_class():
    c = codec()
    answer = pb.ModelInferResponse()
    probability = np.array([[0.25], [0.0], [1e-9]], np.float32)
    scores = np.arange(9, dtype=np.float32).reshape(3, 3) - 4
    for name, array in (("scores", scores), ("probability", probability)):  # Triton's order need not be ours
        answer.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
        answer.raw_output_contents.append(array.tobytes())
    fast = c.BatchResponse.FromString(c.encode(answer, 3, batch=True, batched=True))
    reference = c.BatchResponse()
    for r in range(3):
        reference.results.add(probability=float(probability[r, 0]), scores=scores[r].tolist())
    assert fast == reference
    single = pb.ModelInferResponse()
    for name, array in (("probability", probability[:1]), ("scores", scores[:1])):
        single.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
        single.raw_output_contents.append(array.tobytes())
    assert c.Response.FromString(c.encode(single, 1, batch=False, batched=True)) == reference.results[0]


# ---- the catalog: deploy-time compatibility, persisted ---------------------------------------


def _record(version: int, signature: dict):
    return types.SimpleNamespace(version=version, signature=check_signature(signature), ref=f"fraud:{version}")


def test_the_catalog_bumps_the_major_on_a_breaking_deploy_and_persists_what_it_serves(tmp_path):
    import copy

    from server.control.registry.artifacts import ArtifactStore
    from server.control.registry.registry import Registry
    from server.control.typed.typed_catalog import SchemaCatalog

    registry = Registry(f"sqlite:///{tmp_path}/r.db", ArtifactStore(tmp_path / "artifacts"))
    dp = types.SimpleNamespace(models={})
    added = copy.deepcopy(FRAUD)
    added["inputs"][0]["features"][1]["enum"].append("fuel")
    renamed = copy.deepcopy(added)
    renamed["inputs"][0]["features"][3] = "card_age"

    async def scenario():
        catalog = SchemaCatalog(dp, registry)
        first = await catalog.deployed("fraud", _record(1, FRAUD))
        assert first == "typed API inferplane.models.fraud.v1.FraudService"
        assert "unchanged" in await catalog.deployed("fraud", _record(2, FRAUD))
        note = await catalog.deployed("fraud", _record(3, added))
        assert "v1.1: non-breaking" in note and "enum label fuel = 4 added" in note
        assert sorted(catalog.majors("fraud")) == [1]
        note = await catalog.deployed("fraud", _record(4, renamed))
        assert "inferplane.models.fraud.v2.FraudService: breaking change from v1.1" in note and "retire-schema fraud v1" in note
        assert sorted(catalog.majors("fraud")) == [1, 2] and catalog.live("fraud").model_version == "4"
        assert (await catalog.schema_for("fraud", "v1")).label == "v1.1"
        with pytest.raises(Conflict, match="newest"):
            await catalog.retire("fraud", 2)
        kept = await catalog.retire("fraud", 1, actor="ops")
        assert [s.major for s in kept] == [2]
        with pytest.raises(ModelNotFound, match="already retired"):
            await catalog.retire("fraud", 1)
        with pytest.raises(ModelNotFound, match="was retired"):
            await catalog.schema_for("fraud", "v1")
        # a frontend that starts again serves what was persisted, and numbers the next major after the retired one
        again = SchemaCatalog(dp, registry)
        again.load()
        assert sorted(again.majors("fraud")) == [2] and again.live("fraud") == catalog.live("fraud")
        back = await again.deployed("fraud", _record(5, FRAUD))
        assert "v3.FraudService: breaking" in back and sorted(again.majors("fraud")) == [2, 3]

    try:
        asyncio.run(scenario())
    finally:
        registry.close()


def test_a_catalog_that_never_leads_follows_what_the_leaders_deploys_and_retirements_wrote(tmp_path):
    """A frontend or worker without a registry reads the leader's schemas from the database (its own engine):
    a breaking deploy's v2 and a retirement reach it at its next read, and a read changes nothing twice."""
    import copy

    from server.control.registry.artifacts import ArtifactStore
    from server.control.registry.registry import Registry
    from server.control.typed.typed_catalog import SchemaCatalog
    from server.control.typed.typed_store import TypedSchemaStore
    from server.db import make_engine

    url = f"sqlite:///{tmp_path}/r.db"
    registry = Registry(url, ArtifactStore(tmp_path / "artifacts"))
    engine = make_engine(url)
    dp = types.SimpleNamespace(models={}, names=lambda: [], signature=lambda name: None)
    renamed = copy.deepcopy(FRAUD)
    renamed["inputs"][0]["features"][3] = "card_age"

    async def scenario():
        leader = SchemaCatalog(dp, registry)
        follower = SchemaCatalog(dp, store=TypedSchemaStore(engine))
        assert not await follower.reload() and follower.majors("fraud") == {}
        await leader.deployed("fraud", _record(1, FRAUD))
        assert await follower.reload() and sorted(follower.majors("fraud")) == [1]
        revision = follower.revision
        assert not await follower.reload() and follower.revision == revision  # nothing new: the services are not rebuilt
        await leader.deployed("fraud", _record(2, renamed))
        assert not await leader.reload()  # the leader reads back what it wrote: its services are not rebuilt each second
        task = asyncio.create_task(follower.follow(0.01))  # what every process with a store runs
        try:
            for _ in range(500):
                if sorted(follower.majors("fraud")) == [1, 2]:
                    break
                await asyncio.sleep(0.01)
            assert sorted(follower.majors("fraud")) == [1, 2] and follower.live("fraud") == leader.live("fraud")
            await leader.retire("fraud", 1, actor="ops")
            for _ in range(500):
                if sorted(follower.majors("fraud")) == [2]:
                    break
                await asyncio.sleep(0.01)
            assert sorted(follower.majors("fraud")) == [2]
            with pytest.raises(ModelNotFound, match="was retired"):
                await follower.schema_for("fraud", "v1")
        finally:
            task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        registry.close()
        engine.dispose()


def test_a_follower_before_the_leaders_first_migration_starts_and_reads_later(tmp_path):
    """No ``typed_schemas`` table yet: the catalog is built (derived schemas only) and its reads fail softly."""
    from server.composition import ControlParts, schema_catalog
    from server.control.typed.typed_store import TypedSchemaStore
    from server.db import make_engine

    engine = make_engine(f"sqlite:///{tmp_path}/empty.db")
    dp = types.SimpleNamespace(models={}, names=lambda: [], signature=lambda name: None)
    try:
        catalog = schema_catalog(dp, ControlParts(), None, TypedSchemaStore(engine))
        assert catalog.served() == []

        async def one_round():
            task = asyncio.create_task(catalog.follow(0.01))
            await asyncio.sleep(0.05)
            assert not task.done()  # the failed reads did not end the task
            task.cancel()

        asyncio.run(one_round())
    finally:
        engine.dispose()


def test_the_store_replaces_a_majors_row_and_keeps_when_it_was_created(tmp_path):
    """``save`` of a (endpoint, major) already there updates that row (db.upsert): one row, its created_at kept."""
    from server.control.registry.artifacts import ArtifactStore
    from server.control.registry.registry import Registry
    from server.control.typed.typed_store import TypedSchemaStore

    registry = Registry(f"sqlite:///{tmp_path}/r.db", ArtifactStore(tmp_path / "artifacts"))
    try:
        store = TypedSchemaStore(registry.engine)
        store.save("fraud", {"major": 1, "revision": 0, "model_version": "1"}, actor="a")
        (first,) = store.rows("fraud")
        store.save("fraud", {"major": 1, "revision": 1, "model_version": "2"}, actor="b")
        store.save("fraud", {"major": 2, "revision": 0, "model_version": "3"}, actor="b")
        one, two = store.rows("fraud")
        assert (one["id"], one["created_at"]) == (first["id"], first["created_at"])
        assert (one["revision"], one["model_version"], one["actor"], two["major"]) == (1, "2", "b", 2)
        assert one["updated_at"] >= first["updated_at"] and two["created_at"] >= one["created_at"]
    finally:
        registry.close()
