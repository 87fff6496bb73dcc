"""Pre-serialized ModelInferRequest pools, built once before a run.

The hot loop only picks bytes from the pool; no protobuf or numpy work happens per request.
Data comes either from the model's validation set (`<repository>/<model>/validation.npz`,
array `features`) or is random data shaped after the model's ModelMetadata signature.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from server.codecs import numpy_dtype, serialize_bytes

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


def random_pool(metadata, *, batch: int = 1, size: int = 64, seed: int = 0, version: str = "") -> list[bytes]:
    """`size` requests of random data matching the metadata signature."""
    rng = np.random.default_rng(seed)
    pool = []
    for i in range(size):
        inputs = []
        for t in metadata.inputs:
            shape = concrete_shape(t.shape, batch)
            inputs.append((t.name, t.datatype, shape, _random_tensor(t.datatype, shape, rng)))
        pool.append(_build_request(metadata.name, version, inputs, str(i)))
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
) -> list[bytes]:
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
        pool.append(_build_request(metadata.name, version, [(spec.name, spec.datatype, shape, arr.tobytes())], str(i)))
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
) -> list[bytes]:
    if data == "random":
        return random_pool(metadata, batch=batch, size=size, seed=seed, version=version)
    if data == "validation":
        if repository is None:
            raise ValueError("--data validation needs --repository")
        features = load_validation_features(repository, metadata.name)
        return validation_pool(metadata, features, batch=batch, size=size, version=version)
    raise ValueError(f"unknown data source {data!r} (validation|random)")
