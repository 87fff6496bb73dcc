"""Which artifact formats the registry accepts, detected from the bytes; pickle is refused.

Accepted (non-executable) formats: ONNX, XGBoost JSON / UBJ, LightGBM text, safetensors (with JSON
companions such as ``config.json`` / ``tokenizer.json``) and TensorRT plans. Anything that is a
pickle — ``.pkl``, ``.joblib``, ``.pt`` / ``.pth``, a pickle opcode stream under another name, a
PyTorch zip holding ``data.pkl``, a compressed pickle — is refused with an error naming the safe
alternative. Nothing here ever unpickles: ``pickletools.genops`` only walks the opcodes.
"""

from __future__ import annotations

import bz2
import io
import json
import lzma
import pickletools
import struct
import zipfile
import zlib
from pathlib import PurePath

from server.errors import InvalidRequest

ONNX = "onnx"
XGBOOST_JSON = "xgboost-json"
XGBOOST_UBJ = "xgboost-ubj"
LIGHTGBM_TEXT = "lightgbm-text"
SAFETENSORS = "safetensors"
TENSORRT_PLAN = "tensorrt-plan"
JSON = "json"  # a companion file (config, tokenizer), never a model on its own

MODEL_FORMATS = (ONNX, XGBOOST_JSON, XGBOOST_UBJ, LIGHTGBM_TEXT, SAFETENSORS, TENSORRT_PLAN)
FRAMEWORKS = {
    ONNX: "onnxruntime",
    XGBOOST_JSON: "xgboost",
    XGBOOST_UBJ: "xgboost",
    LIGHTGBM_TEXT: "lightgbm",
    SAFETENSORS: "safetensors",
    TENSORRT_PLAN: "tensorrt",
}
# the file name an artifact of each format gets in a Triton version directory
FILE_NAMES = {
    ONNX: "model.onnx",
    XGBOOST_JSON: "model.json",
    XGBOOST_UBJ: "model.ubj",
    LIGHTGBM_TEXT: "model.txt",
    SAFETENSORS: "model.safetensors",
    TENSORRT_PLAN: "model.plan",
}

SAFE_LIST = "ONNX, safetensors, XGBoost JSON/UBJ, LightGBM text or a TensorRT plan"
_PICKLE_SUFFIXES = {
    ".pkl": "a Python pickle",
    ".pickle": "a Python pickle",
    ".joblib": "a joblib (pickle) dump",
    ".pt": "a PyTorch checkpoint (pickle)",
    ".pth": "a PyTorch checkpoint (pickle)",
    ".ckpt": "a checkpoint (pickle)",
    ".sav": "a pickled model",
    ".dill": "a dill (pickle) dump",
    ".cloudpickle": "a cloudpickle dump",
}
_PLAN_SUFFIXES = {".plan", ".engine", ".trt"}
_SNIFF_BYTES = 1 << 20


class UnsafeArtifact(InvalidRequest):
    """The artifact is pickle-based (or not a recognised safe format) and will not be stored."""


def alternative(filename: str = "", hint: str = "") -> str:
    """What to save instead of a pickle, tailored to what the file looks like."""
    text = f"{filename} {hint}".lower()
    if any(s in text for s in (".pt", ".pth", "torch", "data.pkl", ".ckpt", ".bin")):
        return "export the network to ONNX (torch.onnx.export) or save its weights with safetensors (safetensors.torch.save_file)"
    if "xgb" in text or "xgboost" in text:
        return "save the booster as XGBoost JSON or UBJ (booster.save_model('model.json'))"
    if "lgb" in text or "lightgbm" in text:
        return "save the booster as LightGBM text (booster.save_model('model.txt'))"
    if "joblib" in text or "sklearn" in text:
        return "convert the estimator to ONNX (skl2onnx.to_onnx) or use XGBoost JSON / LightGBM text"
    return f"save the model as {SAFE_LIST}"


def _refuse_pickle(filename: str, what: str) -> UnsafeArtifact:
    return UnsafeArtifact(
        f"refusing {filename or 'artifact'}: it is {what}, and pickle runs arbitrary code when loaded; "
        f"{alternative(filename, what)}"
    )


def is_pickle(data: bytes) -> bool:
    """True when ``data`` is a pickle opcode stream (walked, never executed) ending in STOP."""
    if not data:
        return False
    first = data[0]
    if first == 0x80:
        if len(data) < 2 or data[1] > 5:
            return False
    elif chr(first) not in "(}]cKJMNIFSVX":  # protocol 0/1 streams start with one of these opcodes
        return False
    count = 0
    try:
        for opcode, _arg, _pos in pickletools.genops(io.BytesIO(data)):
            count += 1
            if opcode.name == "STOP":
                return count >= 2
    except Exception:  # not a valid opcode stream
        return False
    return False


def _zip_pickle(data: bytes) -> str | None:
    """The pickle member inside a zip (PyTorch's format is a zip holding ``data.pkl``), if any."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for info in zf.infolist():
                name = info.filename.lower()
                if name.endswith((".pkl", ".pickle")):
                    return info.filename
                if info.file_size and not info.is_dir():
                    with zf.open(info) as member:
                        if is_pickle(member.read(_SNIFF_BYTES)):
                            return info.filename
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError):
        return None
    return None


def _decompressed_head(data: bytes) -> bytes | None:
    """The first bytes of a gzip / zlib / bz2 / xz / lzma stream (how joblib compresses pickles)."""
    try:
        if data[:2] == b"\x1f\x8b":
            return zlib.decompressobj(wbits=31).decompress(data, _SNIFF_BYTES)
        if data[:1] == b"\x78" and data[1:2] in (b"\x01", b"\x5e", b"\x9c", b"\xda"):
            return zlib.decompressobj().decompress(data, _SNIFF_BYTES)
        if data[:3] == b"BZh":
            return bz2.BZ2Decompressor().decompress(data, _SNIFF_BYTES)
        if data[:6] == b"\xfd7zXZ\x00" or data[:1] == b"\x5d":
            return lzma.LZMADecompressor().decompress(data, _SNIFF_BYTES)
    except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error):
        return None
    return None


def _json(data: bytes):
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None


def _is_onnx(data: bytes) -> bool:
    try:
        import onnx
    except ImportError:  # pragma: no cover - onnx is a dependency
        return False
    try:
        model = onnx.ModelProto.FromString(data)
    except Exception:
        return False
    return model.ir_version > 0 and model.HasField("graph") and (len(model.graph.node) > 0 or len(model.graph.output) > 0)


def _is_safetensors(data: bytes) -> bool:
    if len(data) < 10:
        return False
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len < 2 or 8 + header_len > len(data) or data[8:9] != b"{":
        return False
    header = _json(data[8 : 8 + header_len])
    if not isinstance(header, dict):
        return False
    body = len(data) - 8 - header_len
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or "dtype" not in entry or "data_offsets" not in entry:
            return False
        start, end = entry["data_offsets"]
        if not 0 <= start <= end <= body:
            return False
    return True


def _is_lightgbm_text(data: bytes) -> bool:
    head = data[:4096]
    return head.startswith(b"tree\n") and b"version=" in head


def _is_xgboost_ubj(data: bytes) -> bool:
    return data[:1] == b"{" and b"learner" in data[:32] and _json(data) is None


def detect_format(data: bytes, filename: str = "") -> str:
    """The safe format of ``data`` (one of MODEL_FORMATS or JSON); raise UnsafeArtifact otherwise."""
    suffix = PurePath(filename).suffix.lower() if filename else ""
    if suffix in _PICKLE_SUFFIXES:
        raise _refuse_pickle(filename, _PICKLE_SUFFIXES[suffix])
    if is_pickle(data[:_SNIFF_BYTES]) or is_pickle(data):
        raise _refuse_pickle(filename, "a pickle opcode stream")
    if data[:4] == b"PK\x03\x04":
        member = _zip_pickle(data)
        if member is not None:
            raise _refuse_pickle(filename, f"a zip archive holding the pickle '{member}' (the PyTorch save format)")
        raise UnsafeArtifact(f"refusing {filename or 'artifact'}: zip archives are not a model format; upload {SAFE_LIST}")
    head = _decompressed_head(data)
    if head is not None:
        if is_pickle(head):
            raise _refuse_pickle(filename, "a compressed pickle (the joblib dump format)")
        raise UnsafeArtifact(f"refusing {filename or 'artifact'}: compressed streams are not a model format; upload {SAFE_LIST}")
    if _is_safetensors(data):
        return SAFETENSORS
    if _is_lightgbm_text(data):
        return LIGHTGBM_TEXT
    if _is_xgboost_ubj(data):
        return XGBOOST_UBJ
    if data[:1] in (b"{", b"[") or suffix == ".json":
        parsed = _json(data)
        if isinstance(parsed, dict) and "learner" in parsed and "version" in parsed:
            return XGBOOST_JSON
        if parsed is not None:
            return JSON
    if data[:4] in (b"ftrt", b"ptrt") or (suffix in _PLAN_SUFFIXES and data):
        return TENSORRT_PLAN
    if _is_onnx(data):
        return ONNX
    raise UnsafeArtifact(f"refusing {filename or 'artifact'}: not a recognised safe format; upload {SAFE_LIST}")


def check_model(data: bytes, filename: str = "", declared: str | None = None) -> str:
    """Detect the model format and check it against the declared one; return the format."""
    found = detect_format(data, filename)
    if found == JSON:
        raise UnsafeArtifact(
            f"{filename or 'artifact'} is plain JSON: JSON is accepted only as a companion file (config, tokenizer) "
            f"of a safetensors model; the model itself must be {SAFE_LIST}"
        )
    if declared and declared != found:
        raise InvalidRequest(f"{filename or 'artifact'} was declared as {declared} but its bytes are {found}")
    return found


def check_companion(data: bytes, filename: str) -> None:
    """A companion file of a safetensors model: JSON (config, tokenizer) or text vocabularies."""
    found = detect_format(data, filename)
    if found not in (JSON, SAFETENSORS):
        raise UnsafeArtifact(f"companion file {filename} must be JSON or safetensors, got {found}")
