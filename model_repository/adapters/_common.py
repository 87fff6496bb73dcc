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
        self.input_dims: list[int] = [int(d) for d in config["input"][0].get("dims", [])]
        self.output_name: str = config["output"][0]["name"]
        self.output_dims: list[int] = [int(d) for d in config["output"][0]["dims"]]
        self.threads: int = max(1, int(params.get("threads") or 1))
        self.parameters: dict[str, str] = params
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        artifact = params.get("artifact", "")
        if not artifact or Path(artifact).name != artifact:
            raise ArtifactMismatch(f"parameter 'artifact' must be a file name, got {artifact!r}")
        self.artifact: Path = verify_artifact(version_dir / artifact, params.get("artifact_sha256", ""))


def session_providers(requested: str, available: Sequence[str]) -> list[str]:
    """ONNX Runtime's providers for a session: the config's ``providers`` parameter (best first; CPU
    when empty), every one present in ``available``; a missing one fails the load with its name
    (a GPU model never falls back to the CPU silently)."""
    wanted = [p.strip() for p in (requested or "CPUExecutionProvider").split(",") if p.strip()] or ["CPUExecutionProvider"]
    missing = [p for p in wanted if p not in available]
    if missing:
        raise RuntimeError(
            f"the config asks for {', '.join(missing)}, which this onnxruntime lacks (it has {', '.join(available)}); "
            "install onnxruntime-gpu for CUDA / TensorRT"
        )
    return wanted


# ---- one batch, each request answered on its own ---------------------------------------------

MAX_ERROR_CHARS = 1000  # a Triton error travels as a gRPC status message: keep it far below 16 KiB


class BadInput(ValueError):
    """The request cannot be served as sent (the caller's mistake): INVALID_ARG, for it alone."""


def error_response(pb_utils: Any, message: str, code: str = "INTERNAL") -> Any:
    """An error response with its own ``TritonError``.

    Never share one ``TritonError`` between responses: the stub copies an error into shared memory
    each time a response carrying it is sent, and a second copy frees the first one while the
    first response still points at it — Triton then reads freed memory (garbage messages, and a
    SIGSEGV of tritonserver itself). So every response gets a fresh error object.
    """
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + f"... ({len(message) - MAX_ERROR_CHARS} more characters)"
    value = getattr(pb_utils.TritonError, code, None)
    try:
        error = pb_utils.TritonError(message, value) if value is not None else pb_utils.TritonError(message)
    except TypeError:  # a stub whose TritonError takes the message only
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


# what a request's failure must never swallow (a pyo3 panic from a tokenizer is a BaseException too)
_FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def answer_each(
    requests: Sequence[Any],
    pb_utils: Any,
    parse: Callable[[Any], Any],
    compute: Callable[[list[Any]], list[Any]],
    respond: Callable[[Any], Any],
) -> list[Any]:
    """One response per request, whatever the others in the batch hold.

    ``parse(request)`` reads one request (raising :class:`BadInput` for a caller mistake);
    ``compute(items)`` runs the model once over every parsed item and returns one result per
    item; ``respond(result)`` builds that request's response. A request that fails to parse gets
    its own INVALID_ARG error and stays out of the model call. When the batched call fails, each
    item is computed alone, so only the requests that fail by themselves get an error (INTERNAL)
    and the good ones still answer. Never raises.
    """
    responses: list[Any] = [None] * len(requests)
    parsed: list[tuple[int, Any]] = []
    for index, request in enumerate(requests):
        try:
            parsed.append((index, parse(request)))
        except BadInput as exc:
            responses[index] = error_response(pb_utils, f"invalid request: {exc}", "INVALID_ARG")
        except BaseException as exc:  # noqa: BLE001 - one request's failure is its own
            if isinstance(exc, _FATAL):
                raise
            responses[index] = error_response(pb_utils, _describe(exc))

    def finish(group: list[tuple[int, Any]]) -> None:
        results = compute([item for _, item in group])
        if len(results) != len(group):
            raise RuntimeError(f"the model answered {len(results)} results for {len(group)} requests")
        built = [respond(result) for result in results]
        for (index, _), response in zip(group, built):
            responses[index] = response

    if parsed:
        try:
            finish(parsed)
        except BaseException as exc:  # noqa: BLE001 - find which requests fail on their own
            if isinstance(exc, _FATAL):
                raise
            if len(parsed) == 1:
                responses[parsed[0][0]] = error_response(pb_utils, _describe(exc))
            else:
                for one in parsed:
                    try:
                        finish([one])
                    except BadInput as alone:
                        responses[one[0]] = error_response(pb_utils, f"invalid request: {alone}", "INVALID_ARG")
                    except BaseException as alone:  # noqa: BLE001
                        if isinstance(alone, _FATAL):
                            raise
                        responses[one[0]] = error_response(pb_utils, _describe(alone))
    for index, response in enumerate(responses):
        if response is None:  # cannot happen; never answer fewer responses than requests
            responses[index] = error_response(pb_utils, "no response was produced")
    return responses


# ---- the tabular adapters (ONNX Runtime, XGBoost, LightGBM): FP32 rows in, FP32 rows out -------


def feature_rows(array: np.ndarray, dims: Sequence[int]) -> np.ndarray:
    """One request's input as ``[rows, *dims]`` FP32; raise BadInput when it cannot be."""
    array = np.asarray(array)
    if array.dtype.kind not in "fiub":
        raise BadInput(f"features must be numbers, got dtype {array.dtype}")
    if array.ndim != 1 + len(dims):
        raise BadInput(f"features must have rank {1 + len(dims)} (batch + {list(dims)}), got shape {list(array.shape)}")
    for axis, (got, want) in enumerate(zip(array.shape[1:], dims), start=1):
        if want != -1 and got != want:
            raise BadInput(f"features shape[{axis}] must be {want}, got {got} (shape {list(array.shape)})")
    return np.ascontiguousarray(array, dtype=np.float32)


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
    """One model call for all ``requests``; each request gets its own answer or its own error."""

    def parse(request: Any) -> np.ndarray:
        tensor = pb_utils.get_input_tensor_by_name(request, settings.input_name)
        if tensor is None:
            raise BadInput(f"input '{settings.input_name}' is missing")
        return feature_rows(tensor.as_numpy(), settings.input_dims)

    def compute(arrays: list[np.ndarray]) -> list[np.ndarray]:
        nonempty = [a for a in arrays if a.shape[0] > 0]
        pieces = iter(())
        if nonempty:
            batch, counts = concat_batch(nonempty)
            pieces = iter(split_batch(predict(batch), counts, settings.output_dims))
        empty = np.zeros((0, *settings.output_dims), dtype=np.float32)
        return [next(pieces) if a.shape[0] > 0 else empty for a in arrays]

    def respond(piece: np.ndarray) -> Any:
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(settings.output_name, piece)])

    return answer_each(requests, pb_utils, parse, compute, respond)
