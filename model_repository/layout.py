"""One model directory in the Triton repository: config, adapter, artifact, metadata, validation set.

```
NAME/config.pbtxt          backend "python", parameters artifact / artifact_sha256 / threads
NAME/1/model.py            the runtime adapter for the framework
NAME/1/_common.py          helpers the adapter imports
NAME/1/<artifact>          model.onnx | model.json | model.txt
NAME/inferplane.json       metadata: framework, format, sha256, signature, seed
NAME/validation.npz        features + expected outputs computed in-process by the framework
```
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from model_repository.config_writer import ServingConfig, python_backend_config, write_config

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
# what model builds cache between runs (converted, exported, trained weights), keyed by what they are made from
CACHE_ROOT = Path(os.environ.get("INFERPLANE_CACHE", Path.home() / ".cache" / "inferplane"))
ADAPTERS = {"onnxruntime": "onnx_runtime.py", "xgboost": "xgboost_runtime.py", "lightgbm": "lightgbm_runtime.py"}
METADATA_FILE = "inferplane.json"
VALIDATION_FILE = "validation.npz"
VERSION = "1"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[int, ...]
    range: tuple[float, float] | None = None
    # named features of a tabular input, one per element ({"name", "unit"?, "range"?, "enum"?, ...}):
    # the fields of the model's typed gRPC API (server/control/typed/typed_schema.py)
    features: tuple[dict[str, Any], ...] = ()

    def signature(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.name, "datatype": "FP32", "dims": list(self.dims)}
        if self.range is not None:
            entry["range"] = [float(self.range[0]), float(self.range[1])]
        if self.features:
            entry["features"] = [dict(f) for f in self.features]
        return entry


@dataclass(frozen=True)
class ModelBundle:
    """A trained model's artifact bytes, signature and validation rows, ready to be written."""

    name: str
    framework: str  # a key of ADAPTERS
    format: str  # onnx | xgboost-json | lightgbm-text
    artifact_name: str
    artifact: bytes
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    features: np.ndarray
    expected: np.ndarray
    seed: int
    extra: dict[str, Any] = field(default_factory=dict)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def install_adapter(version_dir: Path, adapter: str, *helpers: str, entry: str = "model.py") -> None:
    """Copy the Python-backend adapter ``adapter`` into ``version_dir`` as ``entry`` (``model.py``),
    with ``_common.py`` (the artifact digest check every adapter runs) and ``helpers`` beside it."""
    version_dir = Path(version_dir)
    shutil.copyfile(ADAPTERS_DIR / adapter, version_dir / entry)
    for name in ("_common.py", *helpers):
        shutil.copyfile(ADAPTERS_DIR / name, version_dir / name)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` layout (stored .npy members) with fixed zip timestamps, so the bytes are reproducible."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            zf.writestr(zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buffer.getvalue())


def write_model(out: Path, bundle: ModelBundle, serving: ServingConfig = ServingConfig(), threads: int = 1) -> Path:
    """Write ``out/NAME`` (replacing an old one) and return the model directory."""
    model_dir = Path(out) / bundle.name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version_dir = model_dir / VERSION
    version_dir.mkdir(parents=True)
    digest = sha256_bytes(bundle.artifact)
    (version_dir / bundle.artifact_name).write_bytes(bundle.artifact)
    install_adapter(version_dir, ADAPTERS[bundle.framework])
    parameters = {"artifact": bundle.artifact_name, "artifact_sha256": digest, "threads": str(threads)}
    config = python_backend_config(
        bundle.name,
        {t.name: t.dims for t in bundle.inputs},
        {t.name: t.dims for t in bundle.outputs},
        serving,
        parameters,
    )
    write_config(config, model_dir)
    save_npz(model_dir / VALIDATION_FILE, {"features": bundle.features, "expected": bundle.expected})
    metadata = {
        "name": bundle.name,
        "framework": bundle.framework,
        "format": bundle.format,
        "artifact": f"{VERSION}/{bundle.artifact_name}",
        "sha256": digest,
        "signature": {
            "inputs": [t.signature() for t in bundle.inputs],
            "outputs": [t.signature() for t in bundle.outputs],
        },
        "max_batch_size": serving.max_batch_size,
        "validation": VALIDATION_FILE,
        "training": {"seed": bundle.seed, **bundle.extra},
    }
    (model_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return model_dir


def read_metadata(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / METADATA_FILE).read_text(encoding="utf-8"))


def load_validation(model_dir: Path) -> dict[str, np.ndarray]:
    with np.load(Path(model_dir) / VALIDATION_FILE, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}
