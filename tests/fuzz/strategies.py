"""Hypothesis strategies for malformed requests: the OIP protobuf (ModelInferRequest, as sent on
ModelInfer and on ModelStreamInfer) and the REST bodies (v2 infer JSON and binary extension,
v1 predict, OpenAI chat / completions / embeddings).

Every strategy starts from something valid and mutates it — fields, shapes, datatypes, raw
contents, parameters, model names — or replaces it with noise, so most examples are close enough
to valid to get past the first check and reach deeper code. Unknown model names the fuzz makes up
carry :data:`MARKER`, so the harness can tell whether any caller string became a metric label.
"""

from __future__ import annotations

import json
import struct

import numpy as np
from hypothesis import strategies as st

from server.protogen.inference import grpc_service_pb2 as pb

MARKER = "zzfuzz"  # in every unknown model name the fuzz invents (never a real model's name)

# model -> (input name, datatype, per-row dims); what a valid request for it looks like
TABULAR = {
    "mlp_classifier": ("features", "FP32", [64]),
    "fraud_xgboost": ("features", "FP32", [32]),
    "lightgbm_regressor": ("features", "FP32", [16]),
}
EMBEDDINGS = "minilm_embeddings"
LLM = "tiny_llama"
MODELS = [*TABULAR, EMBEDDINGS, LLM]
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES"]

_ANY_TEXT = st.text(max_size=30)
_MUTATION_COUNT = st.sampled_from([0, 0, 1, 1, 1, 2, 3, 4])


def _mostly(valid, invalid):
    """``valid`` three times out of four: most fields stay right, so an example reaches deep."""
    return st.one_of(valid, valid, valid, invalid)
_NAME = st.one_of(
    st.sampled_from(MODELS),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=20).map(lambda s: f"{MARKER}_{s}"),
    _ANY_TEXT,
    st.just(""),
    st.just("x" * 10_000),
)
_DIM = st.one_of(st.integers(-3, 70), st.sampled_from([0, -1, 2**31, 2**62, -(2**63)]))
_SHAPE = st.lists(_DIM, max_size=5)


def bytes_tensor(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def _valid_raw(model: str, rows: int) -> tuple[str, str, list[int], bytes]:
    if model in TABULAR:
        name, datatype, dims = TABULAR[model]
        return name, datatype, [rows, *dims], np.full((rows, *dims), 0.5, np.float32).tobytes()
    if model == EMBEDDINGS:
        return "text", "BYTES", [rows, 1], bytes_tensor(*[b"fuzz text"] * rows)
    return "text_input", "BYTES", [1], bytes_tensor(b"hello")


_PARAM_VALUE = st.one_of(
    st.booleans().map(lambda v: ("bool_param", v)),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: ("int64_param", v)),
    st.integers(0, 2**64 - 1).map(lambda v: ("uint64_param", v)),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda v: ("double_param", v)),
    _ANY_TEXT.map(lambda v: ("string_param", v)),
)
_PARAM_KEY = st.one_of(
    st.sampled_from(["sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output",
                     "binary_data", "classification", "binary_data_size", "shared_memory_region",
                     "triton_enable_empty_final_response", "max_tokens", "headers"]),  # fmt: skip
    _ANY_TEXT,
)
_PARAMS = st.dictionaries(_PARAM_KEY, _PARAM_VALUE, max_size=3)


def _set_params(target, params: dict) -> None:
    for key, (kind, value) in params.items():
        setattr(target[key], kind, value)


@st.composite
def infer_requests(draw, models=MODELS) -> pb.ModelInferRequest:
    """A ModelInferRequest: valid for one of ``models``, then mutated (or not) field by field."""
    model = draw(st.sampled_from(models))
    rows = draw(st.integers(1, 3))
    name, datatype, shape, raw = _valid_raw(model, rows)
    request = pb.ModelInferRequest(model_name=model)
    if model == LLM:
        request.inputs.add(name="parameters", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(bytes_tensor(json.dumps({"max_tokens": 2, "temperature": 0}).encode()))
    tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(raw)
    for _ in range(draw(_MUTATION_COUNT)):  # often none or one: close to valid reaches deeper
        draw(st.sampled_from(_MUTATIONS))(draw, request, tensor)
    return request


def _m_model(draw, r, t):
    r.model_name = draw(_NAME)


def _m_version(draw, r, t):
    r.model_version = draw(st.one_of(st.sampled_from(["1", "2", "0", "-1", "999999999999"]), _ANY_TEXT))


def _m_id(draw, r, t):
    r.id = draw(st.one_of(_ANY_TEXT, st.just("i" * 5000)))


def _m_datatype(draw, r, t):
    t.datatype = draw(st.one_of(st.sampled_from(DATATYPES), _ANY_TEXT, st.just("D" * 10_000)))


def _m_shape(draw, r, t):
    del t.shape[:]
    t.shape.extend(draw(_SHAPE))


def _m_input_name(draw, r, t):
    t.name = draw(st.one_of(st.sampled_from(["features", "text", "text_input", "messages", "parameters", ""]), _ANY_TEXT))


def _m_raw(draw, r, t):
    del r.raw_input_contents[:]
    for blob in draw(st.lists(st.binary(max_size=300), max_size=3)):
        r.raw_input_contents.append(blob)


def _m_raw_bytes_elements(draw, r, t):
    """BYTES framing: lengths past the end, non-UTF-8 text, empty elements."""
    items = draw(st.lists(st.binary(max_size=40), min_size=0, max_size=4))
    blob = bytes_tensor(*items)
    if draw(st.booleans()) and blob:
        blob = blob[: draw(st.integers(0, len(blob) - 1))]
    del r.raw_input_contents[:]
    r.raw_input_contents.append(blob)


def _m_typed_contents(draw, r, t):
    del r.raw_input_contents[:]
    field = draw(st.sampled_from(["fp32_contents", "int_contents", "int64_contents", "uint_contents", "bool_contents",
                                  "bytes_contents", "fp64_contents", "uint64_contents"]))  # fmt: skip
    values = {
        "fp32_contents": st.floats(width=32),
        "fp64_contents": st.floats(),
        "int_contents": st.integers(-(2**31), 2**31 - 1),
        "int64_contents": st.integers(-(2**63), 2**63 - 1),
        "uint_contents": st.integers(0, 2**32 - 1),
        "uint64_contents": st.integers(0, 2**64 - 1),
        "bool_contents": st.booleans(),
        "bytes_contents": st.binary(max_size=20),
    }[field]
    getattr(t.contents, field).extend(draw(st.lists(values, max_size=80)))


def _m_extra_input(draw, r, t):
    r.inputs.add(name=draw(_ANY_TEXT), datatype=draw(st.sampled_from(DATATYPES)), shape=draw(_SHAPE))
    if r.raw_input_contents and draw(st.booleans()):
        r.raw_input_contents.append(draw(st.binary(max_size=64)))


def _m_drop_inputs(draw, r, t):
    del r.inputs[:]
    if draw(st.booleans()):
        del r.raw_input_contents[:]


def _m_outputs(draw, r, t):
    for _ in range(draw(st.integers(1, 3))):
        output = r.outputs.add(name=draw(st.one_of(st.sampled_from(["prediction", "probability", "probabilities",
                                                                   "embedding", "tokens", "text_output", "info"]), _ANY_TEXT)))  # fmt: skip
        _set_params(output.parameters, draw(_PARAMS))
    if draw(st.booleans()):
        o = r.outputs.add(name="prediction")
        o.parameters["classification"].int64_param = draw(st.integers(-5, 2**40))


def _m_many_outputs(draw, r, t):
    for i in range(draw(st.integers(100, 3000))):
        r.outputs.add(name=f"o{i}")


def _m_parameters(draw, r, t):
    _set_params(r.parameters, draw(_PARAMS))
    _set_params(t.parameters, draw(_PARAMS))


_MUTATIONS = [_m_model, _m_version, _m_id, _m_datatype, _m_shape, _m_input_name, _m_raw, _m_raw_bytes_elements,
              _m_typed_contents, _m_extra_input, _m_drop_inputs, _m_outputs, _m_many_outputs, _m_parameters]  # fmt: skip


@st.composite
def raw_infer_bodies(draw, models=MODELS) -> bytes:
    """A serialized request, then byte-level damage: flips, cuts, insertions, or plain noise."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    data = bytearray(draw(infer_requests(models)).SerializeToString())
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


# ---- REST ---------------------------------------------------------------------------------------

_JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), _ANY_TEXT,
    st.just(int("9" * 400)),
)  # fmt: skip
_JSON = st.recursive(_JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_ANY_TEXT, inner, max_size=4)), max_leaves=12)
# raw JSON fragments json.dumps cannot make: lone surrogate escapes, NaN, a 400-digit number, deep nesting
_RAW_FRAGMENTS = ['"\\ud800"', '"x\\udfffy"', "NaN", "Infinity", "-Infinity", "9" * 400, "1e999", "[" * 50 + "]" * 50, '"\\u0000"']


def _mutate_doc(draw, doc):
    """Replace, delete or add values at random paths of a JSON document (in place)."""
    for _ in range(draw(_MUTATION_COUNT)):
        target, key = doc, None
        for _depth in range(draw(st.integers(0, 4))):
            if isinstance(target, dict) and target:
                key = draw(st.sampled_from(sorted(target)))
            elif isinstance(target, list) and target:
                key = draw(st.integers(0, len(target) - 1))
            else:
                break
            if not isinstance(target[key], (dict, list)):
                break
            target = target[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if isinstance(target, dict):
            if action == "add" or not target:
                target[draw(_ANY_TEXT)] = draw(_JSON)
            else:
                k = draw(st.sampled_from(sorted(target)))
                if action == "delete":
                    del target[k]
                else:
                    target[k] = draw(_JSON)
        elif isinstance(target, list):
            if action == "add" or not target:
                target.append(draw(_JSON))
            else:
                i = draw(st.integers(0, len(target) - 1))
                if action == "delete":
                    del target[i]
                else:
                    target[i] = draw(_JSON)
    return doc


def _encode(draw, doc) -> bytes:
    """JSON text, sometimes with a raw fragment spliced in where a value was."""
    text = json.dumps(doc)
    if draw(st.integers(0, 5)) == 0:
        fragment = draw(st.sampled_from(_RAW_FRAGMENTS))
        for anchor in ('"fuzz text"', "0.5", '"hello"', "null", "true", "false"):
            if anchor in text:
                text = text.replace(anchor, fragment, 1)
                break
        else:
            text = text[:-1] + f', "x": {fragment}}}' if text.endswith("}") and len(text) > 2 else fragment
    return text.encode()


@st.composite
def rest_infer_bodies(draw, models=MODELS) -> tuple[str, bytes, dict[str, str]]:
    """(path, body, headers) for POST /v2/models/{name}/infer: JSON tensors or the binary extension."""
    model = draw(st.sampled_from([m for m in models if m != LLM]))
    rows = draw(st.integers(1, 3))
    name, datatype, shape, raw = _valid_raw(model, rows)
    path_model = draw(_mostly(st.just(model), _NAME.filter(lambda s: s and "/" not in s and "?" not in s and "#" not in s)))
    path = f"/v2/models/{_quote(path_model)}/infer"
    if draw(st.booleans()):  # the binary tensor extension
        data = raw if draw(st.integers(0, 2)) else draw(st.binary(max_size=300))
        tensor = {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(data)}}
        doc = _mutate_doc(draw, {"inputs": [tensor], "parameters": {"binary_data_output": True}})
        header = _encode(draw, doc)
        length = draw(_mostly(st.just(len(header)), st.one_of(st.integers(-5, len(header) + 400), st.sampled_from(["abc", "", "1e3"]))))
        return path, header + data, {"Inference-Header-Content-Length": str(length), "Content-Type": "application/octet-stream"}
    values = np.frombuffer(raw, np.float32).tolist() if datatype == "FP32" else ["fuzz text"] * rows
    doc = _mutate_doc(draw, {"id": "fuzz", "inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": values}],
                             "parameters": {"timeout": 10_000_000}})  # fmt: skip
    content_type = draw(_mostly(st.just("application/json"), st.sampled_from(["", "text/plain", "application/x-www-form-urlencoded"])))
    return path, _encode(draw, doc), {"Content-Type": content_type}


def _quote(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


@st.composite
def rest_predict_bodies(draw) -> tuple[str, bytes, dict[str, str]]:
    model, (name, _dt, dims) = draw(st.sampled_from(sorted(TABULAR.items())))
    rows = draw(st.integers(1, 3))
    doc = _mutate_doc(draw, {"instances": [[0.5] * dims[0] for _ in range(rows)]})
    if draw(st.booleans()):
        doc = _mutate_doc(draw, {"instances": [{name: [0.5] * dims[0]}] * rows})
    path_model = draw(_mostly(st.just(model), st.sampled_from([EMBEDDINGS, f"{MARKER}_predict"])))
    return f"/v1/models/{path_model}:predict", _encode(draw, doc), {"Content-Type": "application/json"}


_TOKENS = st.one_of(st.integers(1, 4), st.integers(-5, 0), st.just(2**65), st.just(int("9" * 400)), st.floats(), _ANY_TEXT, st.none())


@st.composite
def openai_bodies(draw) -> tuple[str, bytes, dict[str, str]]:
    """Chat completions, completions or embeddings: a valid body mutated (fast: a few tokens at most)."""
    kind = draw(st.sampled_from(["chat", "completions", "embeddings"]))
    model = draw(_mostly(st.just(EMBEDDINGS if kind == "embeddings" else LLM), _NAME))
    if kind == "embeddings":
        doc = {"model": model, "input": draw(st.one_of(_ANY_TEXT, st.lists(_ANY_TEXT, max_size=4))),
               "encoding_format": draw(_mostly(st.sampled_from(["float", "base64", None]), st.just("nope")))}  # fmt: skip
        if draw(st.booleans()):
            doc["dimensions"] = draw(_mostly(st.just(384), _TOKENS))
        path = "/v1/embeddings"
    else:
        doc = {"model": model, "max_tokens": draw(_mostly(st.integers(1, 4), _TOKENS)),
               "temperature": draw(_mostly(st.floats(0, 2), st.one_of(st.floats(), st.integers(-3, 2**65)))),
               "seed": draw(_mostly(st.one_of(st.integers(0, 2**31), st.none()), st.integers(-(2**64), 2**64))),
               "stop": draw(_mostly(st.none(), st.one_of(_ANY_TEXT, st.lists(_ANY_TEXT, max_size=5)))),
               "stream": draw(st.booleans()),
               "deadline_ms": draw(_mostly(st.just(2000), st.one_of(st.floats(), st.integers(-1, 2**65))))}  # fmt: skip
        if kind == "chat":
            message = st.fixed_dictionaries({"role": _mostly(st.sampled_from(["user", "system", "assistant"]), _ANY_TEXT), "content": _ANY_TEXT})
            doc["messages"] = draw(_mostly(st.lists(message, min_size=1, max_size=3), _JSON))
            path = "/v1/chat/completions"
        else:
            doc["prompt"] = draw(_mostly(_ANY_TEXT.filter(str.strip), st.one_of(st.lists(_ANY_TEXT, max_size=2), _JSON)))
            path = "/v1/completions"
    doc = _mutate_doc(draw, doc)
    for key in ("max_tokens", "max_completion_tokens"):  # valid lengths stay a few tokens: the fuzz is bounded in time
        value = doc.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 4 < value <= (1 << 20):
            doc[key] = 4
    if kind != "embeddings" and not isinstance(doc.get("max_tokens"), (int, float)) and "max_completion_tokens" not in doc:
        doc.setdefault("max_tokens", 4)
    return path, _encode(draw, doc), {"Content-Type": "application/json"}
