"""Pre-serialized request pools, built once before a run.

The hot loop only picks items from the pool; no protobuf, JSON or numpy work happens per request.
Data comes either from the model's validation set (`<repository>/<model>/validation.npz`,
array `features`) or is random data shaped after the model's metadata signature. The same
tensors are encoded for the target's protocol (`encoding`):

- `grpc`: a serialized `ModelInferRequest` (bytes).
- `rest`: `(body, headers)` with Triton's binary tensor extension: a JSON header (inputs with
  `parameters.binary_data_size`, `binary_data_output: true`), then each input's raw bytes;
  `Inference-Header-Content-Length` names the JSON header's length.
- `rest-json`: `(body, headers)` with JSON `data` tensors (flat, row-major), JSON outputs.

SSE pools (`sse_pool`) are OpenAI chat bodies, one per prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from server.dataplane.codecs import deserialize_bytes, numpy_dtype, serialize_bytes

ENCODINGS = ("grpc", "rest", "rest-json")
HEADER_LENGTH = "Inference-Header-Content-Length"  # server.transports.rest.codec.HEADER_LENGTH

def concrete_shape(shape, batch: int) -> list[int]:
    """Metadata shape with every -1 replaced by the batch size."""
    return [batch if d < 0 else int(d) for d in shape]


def _random_tensor(datatype: str, shape: list[int], rng: np.random.Generator) -> bytes:
    n = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        return serialize_bytes([rng.bytes(int(rng.integers(1, 16))) for _ in range(n)])
    dt = numpy_dtype(datatype)
    if dt.kind == "f":
        arr = rng.standard_normal(n).astype(dt)
    elif dt.kind == "b":
        arr = rng.integers(0, 2, n).astype(dt)
    else:
        arr = rng.integers(0, 100, n).astype(dt)
    return arr.reshape(shape).tobytes()


def _dumps(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def rest_binary_body(inputs, request_id: str = "") -> tuple[bytes, dict[str, str]]:
    """A v2 REST infer body with binary tensors: `inputs` is [(name, datatype, shape, raw)]."""
    doc: dict = {}
    if request_id:
        doc["id"] = request_id
    doc["inputs"] = [
        {"name": name, "datatype": dt, "shape": list(shape), "parameters": {"binary_data_size": len(raw)}}
        for name, dt, shape, raw in inputs
    ]
    doc["parameters"] = {"binary_data_output": True}
    header = _dumps(doc)
    body = b"".join([header, *(raw for _, _, _, raw in inputs)])
    return body, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


def _json_data(datatype: str, raw: bytes) -> list:
    if datatype == "BYTES":  # JSON strings; random bytes go as hex so they stay valid UTF-8
        return [b.hex() for b in deserialize_bytes(raw)]
    if datatype == "BF16":
        raise ValueError("BF16 tensors cannot travel as JSON; drop --rest-json")
    return np.frombuffer(raw, dtype=numpy_dtype(datatype)).tolist()


def rest_json_body(inputs, request_id: str = "") -> tuple[bytes, dict[str, str]]:
    """A v2 REST infer body with JSON tensors (flat `data`, shape given), JSON outputs."""
    doc: dict = {}
    if request_id:
        doc["id"] = request_id
    doc["inputs"] = [
        {"name": name, "datatype": dt, "shape": list(shape), "data": _json_data(dt, raw)}
        for name, dt, shape, raw in inputs
    ]
    return _dumps(doc), {"Content-Type": "application/json"}


def encode_request(encoding: str, model: str, version: str, inputs, request_id: str):
    """One pool item for `encoding` (grpc | rest | rest-json)."""
    if encoding == "grpc":
        return _build_request(model, version, inputs, request_id)
    if encoding == "rest":
        return rest_binary_body(inputs, request_id)
    if encoding == "rest-json":
        return rest_json_body(inputs, request_id)
    raise ValueError(f"unknown request encoding {encoding!r} ({'|'.join(ENCODINGS)})")


def sse_pool(
    model: str, prompts=None, *, max_tokens: int = 64, size: int | None = None, **extra
) -> list[bytes]:
    """OpenAI chat-completion bodies with `stream: true`, one per prompt (cycled up to `size`)."""
    from loadtest.sse import DEFAULT_PROMPTS, chat_body

    prompts = list(prompts or DEFAULT_PROMPTS)
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    n = len(prompts) if size is None else max(1, min(size, len(prompts)))
    return [_dumps(chat_body(model, prompts[i], max_tokens, **extra)) for i in range(n)]


def _build_request(model: str, version: str, inputs, request_id: str) -> bytes:
    from server.protogen.inference import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, datatype, shape, raw in inputs:
        t = req.inputs.add()
        t.name = name
        t.datatype = datatype
        t.shape.extend(shape)
        req.raw_input_contents.append(raw)
    return req.SerializeToString()


def random_pool(
    metadata, *, batch: int = 1, size: int = 64, seed: int = 0, version: str = "", encoding: str = "grpc"
) -> list:
    """`size` requests of random data matching the metadata signature."""
    rng = np.random.default_rng(seed)
    pool = []
    for i in range(size):
        inputs = []
        for t in metadata.inputs:
            shape = concrete_shape(t.shape, batch)
            inputs.append((t.name, t.datatype, shape, _random_tensor(t.datatype, shape, rng)))
        pool.append(encode_request(encoding, metadata.name, version, inputs, str(i)))
    return pool


def load_validation_features(repository: str | Path, model: str) -> np.ndarray:
    path = Path(repository) / model / "validation.npz"
    if not path.is_file():
        raise FileNotFoundError(f"no validation set at {path}")
    with np.load(path, allow_pickle=False) as npz:
        if "features" not in npz:
            raise KeyError(f"{path} has no 'features' array (has {sorted(npz.files)})")
        return np.asarray(npz["features"])


def validation_pool(
    metadata,
    features: np.ndarray,
    *,
    batch: int = 1,
    size: int = 64,
    version: str = "",
    encoding: str = "grpc",
) -> list:
    """Requests cut from consecutive rows of `features` (wrapping around), `batch` rows each."""
    if len(metadata.inputs) != 1:
        raise ValueError(
            f"validation data feeds a single-input model; {metadata.name} has "
            f"{len(metadata.inputs)} inputs (use --data random)"
        )
    spec = metadata.inputs[0]
    if spec.datatype == "BYTES":
        raise ValueError("validation data for BYTES inputs is not supported (use --data random)")
    dt = numpy_dtype(spec.datatype)
    shape = concrete_shape(spec.shape, batch)
    rows = len(features)
    if rows == 0:
        raise ValueError("validation set is empty")
    n_req = max(1, min(size, -(-rows // batch)))
    pool = []
    for i in range(n_req):
        idx = np.arange(i * batch, (i + 1) * batch) % rows
        arr = np.ascontiguousarray(features[idx], dtype=dt)
        if list(arr.shape) != shape:
            if arr.size != int(np.prod(shape)):
                raise ValueError(
                    f"validation rows of shape {list(features.shape[1:])} do not fit input "
                    f"{spec.name} {list(spec.shape)} with batch {batch}"
                )
            arr = arr.reshape(shape)
        inputs = [(spec.name, spec.datatype, shape, arr.tobytes())]
        pool.append(encode_request(encoding, metadata.name, version, inputs, str(i)))
    return pool


def build_pool(
    metadata,
    *,
    data: str = "random",
    repository: str | Path | None = None,
    batch: int = 1,
    size: int = 64,
    seed: int = 0,
    version: str = "",
    encoding: str = "grpc",
) -> list:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown request encoding {encoding!r} ({'|'.join(ENCODINGS)})")
    if data == "random":
        return random_pool(metadata, batch=batch, size=size, seed=seed, version=version, encoding=encoding)
    if data == "validation":
        if repository is None:
            raise ValueError("--data validation needs --repository")
        features = load_validation_features(repository, metadata.name)
        return validation_pool(metadata, features, batch=batch, size=size, version=version, encoding=encoding)
    raise ValueError(f"unknown data source {data!r} (validation|random)")
