"""Shared by the Python-backend adapters; copied beside each ``model.py`` in the version directory.

The Python backend stub puts the version directory on ``sys.path``, so ``model.py`` imports this
as ``_common``. Nothing here imports ``triton_python_backend_utils`` (tests run it without Triton).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np


class ArtifactMismatch(RuntimeError):
    """The artifact on disk is not the one the config names (missing, or wrong sha256)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_artifact(path: Path, expected_sha256: str) -> Path:
    """Return ``path`` if its sha256 is ``expected_sha256``; raise ArtifactMismatch otherwise."""
    path = Path(path)
    if not expected_sha256:
        raise ArtifactMismatch(f"no artifact_sha256 parameter for {path.name}; refusing to load")
    if not path.is_file():
        raise ArtifactMismatch(f"artifact {path} does not exist")
    actual = sha256_file(path)
    if actual != expected_sha256.lower():
        raise ArtifactMismatch(
            f"artifact {path.name} sha256 is {actual}, config expects {expected_sha256}; refusing to load"
        )
    return path


class AdapterSettings:
    """What an adapter reads from Triton's ``initialize(args)``: tensors, artifact, threads."""

    def __init__(self, args: dict[str, str]):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.input_name: str = config["input"][0]["name"]
        self.output_name: str = config["output"][0]["name"]
        self.output_dims: list[int] = [int(d) for d in config["output"][0]["dims"]]
        self.threads: int = max(1, int(params.get("threads") or 1))
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        artifact = params.get("artifact", "")
        if not artifact or Path(artifact).name != artifact:
            raise ArtifactMismatch(f"parameter 'artifact' must be a file name, got {artifact!r}")
        self.artifact: Path = verify_artifact(version_dir / artifact, params.get("artifact_sha256", ""))


def concat_batch(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Stack per-request inputs into one FP32 array; return it and each request's row count."""
    counts = [int(a.shape[0]) for a in arrays]
    batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
    return np.ascontiguousarray(batch, dtype=np.float32), counts


def split_batch(output: np.ndarray, counts: Sequence[int], dims: Sequence[int]) -> list[np.ndarray]:
    """Shape the model's output as ``[rows, *dims]`` FP32 and cut it back into per-request pieces."""
    total = sum(counts)
    output = np.asarray(output, dtype=np.float32).reshape(total, *dims)
    return np.split(output, np.cumsum(counts)[:-1], axis=0) if len(counts) > 1 else [output]


def execute_batched(
    requests: Sequence[Any],
    pb_utils: Any,
    settings: AdapterSettings,
    predict: Callable[[np.ndarray], np.ndarray],
) -> list[Any]:
    """One model call for all ``requests``; an error becomes an error response for each of them."""
    try:
        inputs = [pb_utils.get_input_tensor_by_name(r, settings.input_name).as_numpy() for r in requests]
        batch, counts = concat_batch(inputs)
        pieces = split_batch(predict(batch), counts, settings.output_dims)
    except Exception as exc:  # one bad batch must not take the model down
        error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
        return [pb_utils.InferenceResponse(output_tensors=[], error=error) for _ in requests]
    return [
        pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(settings.output_name, piece)])
        for piece in pieces
    ]
