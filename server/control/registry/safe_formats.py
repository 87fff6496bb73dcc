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
from pathlib import Path, PurePath

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
_PLAN_MAGIC = (b"ptrt", b"ftrt")
_PLAN_HEADER_BYTES = 24
_SNIFF_BYTES = 1 << 20
# a file up to this size is read whole for detection (as bytes are); a larger one only by its header:
# safetensors (header checked against the file's size) and TensorRT plans stream, anything else is read
STREAM_ABOVE = 256 << 20
_MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit on its JSON header


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


class _Discard:
    """Where ``pickletools.dis`` writes its listing: nowhere (only its checks matter here)."""

    @staticmethod
    def write(_text: str) -> None:
        return None


def is_pickle(data: bytes) -> bool:
    """True when ``data`` parses as a pickle opcode stream — walked, never executed.

    Any protocol (0-5 and beyond), with or without the PROTO header: a protocol-4 stream may
    begin with SHORT_BINUNICODE (``8c 08 'builtins' 94 ...``), a protocol-0 one with ``c``
    (GLOBAL) or ``(`` (MARK). ``pickletools.dis`` walks the opcodes with the unpickler's stack
    and memo discipline (pops have something to pop, a MARK exists when one is needed, memo keys
    are stored before use, one object is left at STOP). A stream counts as a pickle when it gets
    to STOP that way, or when the data (a sniffed prefix of a larger file) runs out mid-stream
    with every opcode so far valid. Every format the registry accepts fails this at its first
    bytes (ONNX ``08``, safetensors' length then ``00``, ``{`` JSON/UBJ, ``tree`` LightGBM
    (TUPLE without MARK), ``ftrt``/``ptrt`` plans), so nothing accepted is mistaken for one.
    """
    if not data:
        return False
    stream = io.BytesIO(data)
    try:
        pickletools.dis(stream, out=_Discard())
    except Exception:  # noqa: BLE001 - not an opcode stream, or a prefix of one cut short
        # genops reads an opcode, then its argument: running out of bytes leaves nothing unread
        return stream.tell() >= len(data) and _opcodes_before_end(data) >= 2
    return True


def _opcodes_before_end(data: bytes) -> int:
    """How many opcodes a cut-short stream held, the cut one included when its code is a real
    opcode (a lone opcode byte is not evidence; PROTO then a cut BINBYTES is)."""
    stream, count, end = io.BytesIO(data), 0, 0
    try:
        for _ in pickletools.genops(stream):
            count += 1
            end = stream.tell()
    except Exception:  # noqa: BLE001 - the cut
        if data[end : end + 1].decode("latin-1") in _OPCODE_CODES:
            count += 1
    return count


_OPCODE_CODES = frozenset(op.code for op in pickletools.opcodes)


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
    if header_len < 2 or 8 + header_len > len(data):
        return False
    return _safetensors_header_fits(data[8 : 8 + header_len], len(data) - 8 - header_len)


def _is_tensorrt_plan(data: bytes) -> bool:
    """A serialized TensorRT engine: it starts with the tag ``ptrt`` or ``ftrt`` followed by its
    header (version, sizes: 24 bytes in all), what ``IHostMemory`` from ``serialize()`` holds and
    what Netron's TensorRT reader matches (lutzroeder/netron ``source/tensorrt.js``). The file name
    (``.plan`` / ``.engine`` / ``.trt``) decides nothing: the bytes must say it."""
    return len(data) >= _PLAN_HEADER_BYTES and data[:4] in _PLAN_MAGIC


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
    # A complete safetensors file is recognised first: its 8-byte header length may read as a
    # harmless two-opcode pickle (0x2E4E = 11854 is "N." — None, STOP), but no loadable pickle
    # that imports anything fits before the zero high bytes of a real length and the "{" after it.
    if _is_safetensors(data):
        return SAFETENSORS
    if is_pickle(data[:_SNIFF_BYTES]):
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
    if _is_tensorrt_plan(data):
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


TEXT_COMPANIONS = (".txt", ".jinja")  # vocabularies (merges.txt), chat templates: plain UTF-8 text


def check_companion(data: bytes, filename: str) -> None:
    """A companion file of a safetensors model: JSON (config, tokenizer), safetensors, or plain
    UTF-8 text for a vocabulary or chat template (``.txt``, ``.jinja``; never a pickle)."""
    if PurePath(filename).suffix.lower() in TEXT_COMPANIONS:
        if is_pickle(data[:_SNIFF_BYTES]) or b"\x00" in data:
            raise UnsafeArtifact(f"companion file {filename} must be plain text")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafeArtifact(f"companion file {filename} must be UTF-8 text") from None
        return
    found = detect_format(data, filename)
    if found not in (JSON, SAFETENSORS):
        raise UnsafeArtifact(f"companion file {filename} must be JSON or safetensors, got {found}")


def _safetensors_file(path: Path, size: int) -> bool:
    """A safetensors file checked by its header and size (the tensors' bytes are not read)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return False
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len < 2 or header_len > _MAX_SAFETENSORS_HEADER or 8 + header_len > size:
            return False
        header = f.read(header_len)
    return _safetensors_header_fits(header, size - 8 - header_len)  # the tensors' bytes are never read


def _safetensors_header_fits(header: bytes, body: int) -> bool:
    """A safetensors JSON header whose tensors all lie inside a body of ``body`` bytes."""
    if header[:1] != b"{":
        return False
    parsed = _json(header)
    if not isinstance(parsed, dict):
        return False
    for key, entry in parsed.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or "dtype" not in entry or "data_offsets" not in entry:
            return False
        start, end = entry["data_offsets"]
        if not 0 <= start <= end <= body:
            return False
    return True


def check_model_file(path: Path | str, filename: str = "", declared: str | None = None) -> str:
    """:func:`check_model` for a local file without reading a large one into memory: up to
    ``STREAM_ABOVE`` bytes it is read whole; above, a safetensors file or TensorRT plan is
    recognised by its header (after the pickle checks on its first bytes); other formats are read."""
    path = Path(path)
    filename = filename or path.name
    size = path.stat().st_size
    if size <= STREAM_ABOVE:
        return check_model(path.read_bytes(), filename, declared)
    suffix = PurePath(filename).suffix.lower()
    if suffix in _PICKLE_SUFFIXES:
        raise _refuse_pickle(filename, _PICKLE_SUFFIXES[suffix])
    if _safetensors_file(path, size):
        found = SAFETENSORS
    else:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
        if not _is_tensorrt_plan(head):
            return check_model(path.read_bytes(), filename, declared)  # ONNX (protobuf: under 2 GB) parses whole
        if is_pickle(head):
            raise _refuse_pickle(filename, "a pickle opcode stream")
        found = TENSORRT_PLAN
    if declared and declared != found:
        raise InvalidRequest(f"{filename} was declared as {declared} but its bytes are {found}")
    return found
