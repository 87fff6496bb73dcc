"""Typed per-model APIs, the pure part: signature -> schema -> .proto text and descriptor, the
features check at registration, and the compatibility (breaking-change) table."""

from __future__ import annotations

import copy

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from server.control.typed import typed_compat
from server.control.typed import typed_schema as ts
from server.control.typed.declared_signature import check_signature
from server.dataplane.signature import ModelSignature, TensorSpec
from server.errors import InvalidRequest
from server.control.typed import typed_proto

FRAUD = {
    "inputs": [
        {
            "name": "features",
            "datatype": "FP32",
            "dims": [4],
            "features": [
                {"name": "amount", "unit": "USD", "range": [0, 10000], "description": "card amount"},
                {"name": "merchant_category", "enum": ["grocery", "travel", "electronics"]},
                {"name": "hour_of_day", "range": [0, 23]},
                "card_age_days",
            ],
        }
    ],
    "outputs": [{"name": "probability", "datatype": "FP32", "dims": [1]}],
}


def _schema(signature=FRAUD, name="fraud", **kw) -> ts.TypedSchema:
    optional = [t["name"] for t in signature["inputs"] if t.get("optional")]  # Triton's optional inputs
    return ts.from_signature(name, check_signature(signature), optional_inputs=optional, **kw)


def compile_proto(text: str, file_name: str, tmp_path) -> descriptor_pb2.FileDescriptorProto:
    """protoc (grpcio-tools) on the text: what a caller's build would do."""
    from grpc_tools import protoc

    path = tmp_path / file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{tmp_path}", f"--descriptor_set_out={out}", file_name]) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]


TEXT_AND_TABLES = {
    "inputs": [
        {"name": "text", "datatype": "BYTES", "dims": [1]},
        {"name": "weights", "datatype": "FP32", "dims": [2, 3]},
        {"name": "counts", "datatype": "INT8", "dims": [2], "features": ["clicks", {"name": "views", "range": [0, 100]}]},
        {"name": "flag", "datatype": "BOOL", "dims": [1]},
    ],
    "outputs": [
        {"name": "embedding", "datatype": "FP32", "dims": [8]},
        {"name": "tokens", "datatype": "INT32", "dims": [1]},
        {"name": "label-name", "datatype": "BYTES", "dims": [1]},
    ],
}


@pytest.mark.parametrize("signature", [FRAUD, TEXT_AND_TABLES], ids=["tabular-enum", "text-tensors"])
def test_the_proto_text_compiles_to_the_descriptor_the_server_serves(signature, tmp_path):
    schema = _schema(signature, model_version="3")
    compiled = compile_proto(typed_proto.proto_text(schema), schema.file_name, tmp_path)
    assert compiled == typed_proto.file_descriptor(schema)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(typed_proto.file_descriptor(schema))
    service = pool.FindServiceByName(schema.service)
    assert [m.name for m in service.methods] == ["Predict", "PredictBatch"]


def test_names_fields_and_types_follow_the_signature():
    schema = _schema(name="fraud_xgboost")
    assert schema.package == "inferplane.models.fraud_xgboost.v1"
    assert schema.service == "inferplane.models.fraud_xgboost.v1.FraudXgboostService"
    assert schema.message("Request") == "inferplane.models.fraud_xgboost.v1.FraudXgboostRequest"
    fields = schema.request_fields
    assert [(f.name, f.number, f.type, f.index) for f in fields] == [
        ("amount", 1, "float", 0), ("merchant_category", 2, "MerchantCategory", 1), ("hour_of_day", 3, "float", 2), ("card_age_days", 4, "float", 3),
    ]  # fmt: skip
    assert fields[1].enum == (("grocery", 0.0), ("travel", 1.0), ("electronics", 2.0))
    text = typed_proto.proto_text(schema)
    assert "optional float amount = 1;" in text and "unit: USD; range [0, 10000]" in text
    assert "MERCHANT_CATEGORY_UNSPECIFIED = 0;" in text and "MERCHANT_CATEGORY_ELECTRONICS = 3;" in text
    assert "repeated FraudXgboostRow rows = 1;" in text
    assert "float probability = 1;" in text
    text_model = _schema(TEXT_AND_TABLES, name="my-model.v2")
    assert text_model.package == "inferplane.models.my_model_v2.v1" and text_model.stem == "MyModelV2"
    kinds = {f.name: (f.type, f.repeated, f.count) for f in text_model.request_fields + text_model.response_fields}
    assert kinds["text"] == ("string", False, None) and kinds["weights"] == ("float", True, 6)
    assert kinds["clicks"] == ("int32", False, None) and kinds["flag"] == ("bool", False, None)
    assert kinds["embedding"] == ("float", True, 8) and kinds["tokens"] == ("int32", False, None)
    assert kinds["label_name"] == ("string", False, None)  # tensor 'label-name' as an identifier
    assert ts.camel("3d_model") == "M3dModel" and ts.package_part("3d") == "m_3d"


def test_a_served_model_without_declared_features_gets_tensor_fields():
    sig = ModelSignature(
        name="minilm_embeddings", max_batch_size=64,
        inputs={"text": TensorSpec("text", "BYTES", (1,))},
        outputs={"embedding": TensorSpec("embedding", "FP32", (384,)), "tokens": TensorSpec("tokens", "INT32", (1,))},
        versions=frozenset({"1"}),
    )  # fmt: skip
    schema = ts.from_model_signature(sig)
    assert "optional string text = 1;" in typed_proto.proto_text(schema)
    assert [(f.name, f.repeated, f.count) for f in schema.response_fields] == [("embedding", True, 384), ("tokens", False, None)]
    # the repository's declared signature names the features when its tensors are the served ones
    declared = check_signature({"inputs": [dict(FRAUD["inputs"][0])], "outputs": FRAUD["outputs"]})
    served = ModelSignature("fraud", 8, {"features": TensorSpec("features", "FP32", (4,))}, {"probability": TensorSpec("probability", "FP32", (1,))})
    assert [f.name for f in ts.from_model_signature(served, declared=declared).request_fields][0] == "amount"
    other = ModelSignature("fraud", 8, {"features": TensorSpec("features", "FP32", (5,))}, {"probability": TensorSpec("probability", "FP32", (1,))})
    assert [f.name for f in ts.from_model_signature(other, declared=declared).request_fields] == ["features"]


def test_llms_and_unsupported_tensors_have_no_typed_api():
    llm = ModelSignature(
        "tiny_llama", 0, {"text_input": TensorSpec("text_input", "BYTES", (1,))},
        {"text_output": TensorSpec("text_output", "BYTES", (1,)), "info": TensorSpec("info", "BYTES", (1,))}, decoupled=True,
    )  # fmt: skip
    with pytest.raises(ts.NoTypedApi, match="LLM"):
        ts.from_model_signature(llm)
    with pytest.raises(ts.NoTypedApi, match="variable dims"):
        ts.from_signature("m", {"inputs": [{"name": "image", "datatype": "FP32", "dims": [-1, -1]}], "outputs": FRAUD["outputs"]})
    with pytest.raises(ts.NoTypedApi, match="BF16"):
        ts.from_signature("m", {"inputs": [{"name": "x", "datatype": "BF16", "dims": [4]}], "outputs": FRAUD["outputs"]})


def _with_features(features, dims=(4,), datatype="FP32") -> dict:
    return {"inputs": [{"name": "features", "datatype": datatype, "dims": list(dims), "features": features}], "outputs": FRAUD["outputs"]}


@pytest.mark.parametrize(
    ("signature", "match"),
    [
        (_with_features(["a", "b", "c"]), "declares 3 features for a feature dimension of 4"),
        (_with_features(["a", "b", "c", "d"], dims=(2, 2)), "one fixed dimension"),
        (_with_features(["a", "b", "c", "d"], dims=(-1,)), "one fixed dimension"),
        (_with_features(["a", "b", "c", "2d"]), "'2d' is not a protobuf identifier"),
        (_with_features(["a", "b", "c", "has-dash"]), "not a protobuf identifier"),
        (_with_features(["a", "b", "c", "a"]), "clashes with 'a'"),
        (_with_features(["a", "b", "foo_bar", "fooBar"]), "clashes with 'foo_bar'"),
        (_with_features(["a", "b", "c", "class"]), "reserved"),
        (_with_features(["a", "b", "c", {"name": "d", "range": [2, 1]}]), "is empty"),
        (_with_features(["a", "b", "c", {"name": "d", "enum": []}]), "no labels"),
        (_with_features(["a", "b", "c", {"name": "d", "enum": ["x", "X"]}]), "repeated or reserved"),
        (_with_features(["a", "b", "c", {"name": "d", "enum": ["unspecified"]}]), "repeated or reserved"),
        (_with_features(["a", "b", "c", {"name": "d", "enum": {"x": 1, "y": 1}}]), "repeated or not finite"),
        (_with_features(["a", "b", "c", {"name": "d", "enum": ["ok", "not ok"]}]), "enum label 'not ok'"),
        (_with_features(["a", "b", "c", {"name": "d", "enum": ["x"], "range": [0, 1]}]), "either an enum or has a range"),
        (_with_features(["a", "b", "c", "d"], datatype="BYTES"), "numeric or BOOL"),
        ({"inputs": FRAUD["inputs"], "outputs": [{"name": "p", "datatype": "FP32", "dims": [1], "features": ["x"]}]}, "only inputs"),
    ],
)
def test_features_are_checked_at_registration(signature, match):
    with pytest.raises(InvalidRequest, match=match):
        check_signature(signature)


def test_cross_input_and_type_name_clashes_are_refused_at_registration(tmp_path):
    from server.control.registry.artifacts import ArtifactStore
    from server.control.registry.registry import Registry
    from tests.unit.test_registry import lightgbm

    two = {
        "inputs": [
            {"name": "a", "datatype": "FP32", "dims": [2], "features": ["x", "y"]},
            {"name": "b", "datatype": "FP32", "dims": [2], "features": ["y", "z"]},
        ],
        "outputs": FRAUD["outputs"],
    }
    enum_named_like_a_message = _with_features(["a", "b", "c", {"name": "fraud_request", "enum": ["x"]}])
    registry = Registry(f"sqlite:///{tmp_path}/r.db", ArtifactStore(tmp_path / "artifacts"))
    try:
        with pytest.raises(InvalidRequest, match="feature 'y' of input 'b' clashes"):
            registry.register("fraud", lightgbm(2), signature=two)
        with pytest.raises(InvalidRequest, match="enum type 'FraudRequest'"):
            registry.register("fraud", lightgbm(2), signature=enum_named_like_a_message)
        record, _ = registry.register("fraud", lightgbm(2), signature=FRAUD)
        assert record.signature["inputs"][0]["features"][1]["enum"] == [["grocery", 0.0], ["travel", 1.0], ["electronics", 2.0]]
    finally:
        registry.close()


def test_the_demo_models_declare_named_features():
    from model_repository import demo

    expected = {"fraud_xgboost": 32, "lightgbm_regressor": 16, "mlp_classifier": 64}
    for bundle in (demo.fraud_xgboost(trees=2), demo.lightgbm_regressor(rounds=2), demo.mlp_classifier()):
        signature = check_signature({"inputs": [t.signature() for t in bundle.inputs], "outputs": [t.signature() for t in bundle.outputs]})
        schema = ts.from_signature(bundle.name, signature)
        fields = schema.request_fields
        assert len(fields) == expected[bundle.name] and all(f.range is not None for f in fields)
        lo = [f.range[0] for f in fields]
        hi = [f.range[1] for f in fields]
        assert (bundle.features >= lo).all() and (bundle.features <= hi).all()  # the validation rows are in range
    assert ts.from_signature("fraud_xgboost", check_signature({"inputs": [demo.fraud_xgboost(trees=2).inputs[0].signature()], "outputs": FRAUD["outputs"]})).request_fields[0].name == "amount"


# ---- the breaking-change table ----------------------------------------------------------------


def _edit(fn) -> dict:
    signature = copy.deepcopy(FRAUD)
    fn(signature)
    return signature


def _features(s):
    return s["inputs"][0]["features"]


def _rename(s, i, name):
    _features(s)[i] = {"name": name} if isinstance(_features(s)[i], str) else dict(_features(s)[i], name=name)


def _add_input(s, optional):
    s["inputs"].append({"name": "note", "datatype": "BYTES", "dims": [1], **({"optional": True} if optional else {})})


BREAKING_TABLE = [
    # (case, change to the signature, breaking?, what the change says)
    ("identical", lambda s: None, None, ""),
    ("feature renamed", lambda s: _rename(s, 3, "card_age"), True, "request.card_age_days: field removed"),
    ("features reordered", lambda s: _features(s).reverse(), True, "field number changed 1 -> 4"),
    ("feature type changed (enum -> float)", lambda s: _features(s).__setitem__(1, "merchant_category"), True, "type changed MerchantCategory -> float"),
    ("tensor dtype changed", lambda s: s["inputs"][0].__setitem__("datatype", "FP64"), True, "type changed float -> double"),
    ("enum label removed", lambda s: _features(s)[1].__setitem__("enum", ["grocery", "travel"]), True, "enum label electronics removed"),
    ("enum labels reordered", lambda s: _features(s)[1].__setitem__("enum", ["travel", "grocery", "electronics"]), True, "renumbered"),
    ("enum label means another value", lambda s: _features(s)[1].__setitem__("enum", {"grocery": 5, "travel": 1, "electronics": 2}), True, "now means tensor value 5"),
    ("output removed", lambda s: s["outputs"].__setitem__(0, {"name": "score", "datatype": "FP32", "dims": [1]}), True, "response.probability: field removed"),
    ("output count changed", lambda s: s["outputs"][0].__setitem__("dims", [2]), True, "type changed float -> repeated float[2]"),
    ("new required input", lambda s: _add_input(s, optional=False), True, "request.note: new required field"),
    ("enum label added at the end", lambda s: _features(s)[1]["enum"].append("fuel"), False, "enum label fuel = 4 added"),
    ("new optional input", lambda s: _add_input(s, optional=True), False, "request.note: field added"),
    ("output added", lambda s: s["outputs"].append({"name": "explanation", "datatype": "FP32", "dims": [4]}), False, "response.explanation: field added"),
    ("range widened", lambda s: _features(s)[0].__setitem__("range", [0, 20000]), False, "declared range [0, 10000] -> [0, 20000]"),
    ("unit and description changed", lambda s: _features(s)[0].update(unit="EUR", description="amount in euros"), None, ""),
]


@pytest.mark.parametrize(("case", "edit", "breaking", "says"), BREAKING_TABLE, ids=[row[0] for row in BREAKING_TABLE])
def test_breaking_change_table(case, edit, breaking, says):
    old = _schema()
    new = _schema(_edit(edit))
    changes = typed_compat.compare(old, new)
    if breaking is None:
        assert changes == [], changes
        return
    assert typed_compat.is_breaking(changes) is breaking, changes
    assert any(says in str(c) for c in changes), [str(c) for c in changes]
    if not breaking:  # what an old caller sends is still understood: same numbers, same types
        old_fields = {f.name: (f.number, f.type) for f in old.request_fields}
        assert all(old_fields[f.name] == (f.number, f.type) for f in new.request_fields if f.name in old_fields)


def test_schemas_round_trip_through_json():
    schema = _schema(TEXT_AND_TABLES, model_version="7").with_version(3, 2)
    again = ts.TypedSchema.from_dict(schema.as_dict())
    assert again == schema and again.label == "v3.2" and again.package.endswith(".v3")
