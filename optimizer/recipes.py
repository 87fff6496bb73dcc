"""Recipes: one registered artifact in, one candidate artifact out (or a reason it was skipped).

| recipe | applies to | what it does |
|---|---|---|
| ``graph`` | ONNX | ``onnxslim`` constant folding / simplification (kept only where it removes nodes), then ONNX Runtime's offline graph optimizations at the extended level (fusions such as Gemm+activation) |
| ``fp16`` | ONNX | weights and compute to float16, graph inputs/outputs kept float32 (``onnxconverter-common``); meant for GPUs |
| ``int8-dynamic`` | ONNX | weights int8 per channel, activations quantized on the fly (``quantize_dynamic``) |
| ``int8-static`` | ONNX | QDQ int8 with activation ranges calibrated on rows (the version's validation rows or a file), weights per channel |
| ``int4`` | ONNX | weight-only 4-bit ``MatMulNBits`` (blocks of ``block_size`` along K) for MatMuls whose K is a multiple of the block |
| ``tree-onnx`` | XGBoost, LightGBM | the ensemble compiled to an ONNX ``TreeEnsemble`` graph (``onnxmltools``), run by ONNX Runtime |
| ``tensorrt`` | ONNX | a TensorRT engine plan, where a GPU and TensorRT are present; otherwise skipped with the reason |

Every candidate is deterministic: same input bytes and parameters -> same output bytes (graph
names fixed, protobuf serialized deterministically), so the registry's content addressing makes
optimizing twice a no-op. Native compiled tree predictors (treelite / tl2cgen ``.so``) are not
produced: a shared library is executable code, which the registry's safe-format rule refuses
for the same reason it refuses pickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from server.control.registry import safe_formats

RECIPES = ("graph", "fp16", "int8-dynamic", "int8-static", "int4", "tree-onnx", "tensorrt")
ONNX_RECIPES = ("graph", "fp16", "int8-dynamic", "int8-static", "int4", "tensorrt")
TREE_FORMATS = (safe_formats.XGBOOST_JSON, safe_formats.XGBOOST_UBJ, safe_formats.LIGHTGBM_TEXT)
TREE_OPSET = 15  # the newest default-domain opset onnxmltools' tree converters support
INT4_BLOCK = 32
PRODUCER = "inferplane-optimizer"
# ops that only transformer graphs have: where --all includes INT4
_TRANSFORMER_OPS = {
    "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
    "Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding", "Gelu", "FastGelu", "BiasGelu",
    "EmbedLayerNormalization",
}  # fmt: skip


class Skipped(Exception):
    """The recipe does not apply here (wrong format, no GPU, nothing to quantize): a row, not an error."""

    def __init__(self, recipe: str, reason: str):
        super().__init__(f"{recipe}: {reason}")
        self.recipe = recipe
        self.reason = reason


@dataclass(frozen=True)
class Source:
    """What a recipe starts from: the parent's artifact and what is known about it."""

    name: str
    format: str
    artifact: bytes
    signature: Mapping[str, Any]
    calibration: np.ndarray | None = None  # rows for static quantization
    max_batch: int = 64
    # feeds for static quantization of a multi-input graph (e.g. a text encoder's token ids and
    # masks, one dict per batch); when given they replace ``calibration``
    calibration_feeds: tuple[Mapping[str, np.ndarray], ...] | None = None

    @property
    def input_name(self) -> str:
        return self.signature["inputs"][0]["name"]

    @property
    def input_dims(self) -> list[int]:
        return list(self.signature["inputs"][0]["dims"])

    @property
    def output_name(self) -> str:
        return self.signature["outputs"][0]["name"]

    @property
    def output_dims(self) -> list[int]:
        return list(self.signature["outputs"][0]["dims"])


@dataclass(frozen=True)
class Candidate:
    recipe: str
    artifact: bytes
    format: str
    params: dict[str, Any]
    target: str = "cpu"  # the hardware the recipe is meant for: cpu | gpu
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.artifact).hexdigest()

    @property
    def filename(self) -> str:
        return safe_formats.FILE_NAMES[self.format]


def tool_versions() -> dict[str, str]:
    """Versions of the libraries the recipes call (recorded with every candidate)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("onnx", "onnxruntime", "onnxconverter-common", "onnxmltools", "onnxslim", "xgboost", "lightgbm"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


# ---- ONNX helpers -------------------------------------------------------------------------------


def _load(data: bytes):
    import onnx

    return onnx.ModelProto.FromString(data)


def _name_nodes(model) -> None:
    """Give unnamed nodes stable names (quantizers select and name nodes by them)."""
    for i, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"


def _finish(model, name: str) -> bytes:
    """Fixed graph name and producer, checked, serialized deterministically."""
    import onnx

    model.graph.name = name
    model.producer_name = PRODUCER
    model.producer_version = "1"
    onnx.checker.check_model(model)
    return model.SerializeToString(deterministic=True)


def _require_onnx(source: Source, recipe: str) -> None:
    if source.format != safe_formats.ONNX:
        hint = " (run tree-onnx first; the result is an ONNX version)" if source.format in TREE_FORMATS else ""
        raise Skipped(recipe, f"applies to ONNX graphs, not {source.format}{hint}")


def is_transformer(data: bytes) -> bool:
    """Whether the graph looks like a transformer: normalization/attention ops, or a MatMul of two activations."""
    model = _load(data)
    ops = {n.op_type for n in model.graph.node}
    if ops & _TRANSFORMER_OPS:
        return True
    constants = {i.name for i in model.graph.initializer} | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return any(n.op_type == "MatMul" and not (set(n.input) & constants) for n in model.graph.node)


def _count_nodes(model) -> int:
    return len(model.graph.node)


# ---- recipes ------------------------------------------------------------------------------------


def graph(source: Source) -> Candidate:
    import onnx
    import onnxruntime as ort

    _require_onnx(source, "graph")
    model = _load(source.artifact)
    steps = []
    try:
        import onnxslim

        slim = onnxslim.slim(onnx.ModelProto.FromString(source.artifact))
        if slim is not None and _count_nodes(slim) < _count_nodes(model):
            steps.append(f"onnxslim {_count_nodes(model)}->{_count_nodes(slim)} nodes")
            model = slim
    except ImportError:
        steps.append("onnxslim not installed: simplification skipped")
    with tempfile.TemporaryDirectory() as tmp, _scratch_cwd(tmp):
        out = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(out)
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(out))
    steps.append(f"onnxruntime extended {_count_nodes(model)}->{_count_nodes(optimized)} nodes")
    return Candidate(
        "graph", _finish(optimized, source.name), safe_formats.ONNX,
        {"level": "extended", "execution_provider": "CPUExecutionProvider", "steps": steps},
        notes=("extended-level fusions are ONNX Runtime contrib ops for its CPU provider",),
    )  # fmt: skip


def fp16(source: Source) -> Candidate:
    from onnxconverter_common import float16

    _require_onnx(source, "fp16")
    model = float16.convert_float_to_float16(_load(source.artifact), keep_io_types=True)
    fixed = _retarget_casts(model)
    return Candidate(
        "fp16", _finish(model, source.name), safe_formats.ONNX, {"keep_io_types": True, **({"casts_retargeted": fixed} if fixed else {})}, target="gpu",
        notes=("float16 compute is for GPUs; on CPU it is usually slower",),
    )  # fmt: skip


def _retarget_casts(model) -> int:
    """Cast-to-float32 nodes inside a converted float16 graph now feed float16 ops: make them cast to float16.

    onnxconverter-common converts tensors and value infos but leaves a Cast's ``to`` attribute, so
    e.g. an attention mask cast from int64 to float32 (every BERT export has one) no longer matches
    its declared float16 output and ONNX Runtime refuses the graph. Returns how many were changed.
    """
    from onnx import TensorProto

    half = {vi.name for vi in model.graph.value_info if vi.type.tensor_type.elem_type == TensorProto.FLOAT16}
    outputs = {o.name for o in model.graph.output}
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Cast" or node.output[0] in outputs or node.output[0] not in half:
            continue
        for attr in node.attribute:
            if attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16
                changed += 1
    return changed


@contextlib.contextmanager
def _scratch_cwd(path):
    """Run in ``path``: ONNX Runtime's quantizers drop scratch files (shape-inference temps,
    external tensor data) into the current directory."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _preprocessed(source: Source, tmp: Path) -> Path:
    """Shape inference + basic ORT optimization before quantization (what ORT recommends)."""
    from onnxruntime.quantization import quant_pre_process

    src, pre = tmp / "in.onnx", tmp / "pre.onnx"
    model = _load(source.artifact)
    _name_nodes(model)
    src.write_bytes(model.SerializeToString())
    try:
        quant_pre_process(str(src), str(pre))
    except Exception:  # symbolic shape inference gives up on some graphs: ONNX shape inference still runs
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    return pre


def int8_dynamic(source: Source) -> Candidate:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    _require_onnx(source, "int8-dynamic")
    import onnx

    with tempfile.TemporaryDirectory() as tmp, _scratch_cwd(tmp):
        pre = _preprocessed(source, Path(tmp))
        out = Path(tmp) / "int8.onnx"
        quantize_dynamic(str(pre), str(out), per_channel=True, weight_type=QuantType.QInt8)
        model = onnx.load(str(out))
    return Candidate(
        "int8-dynamic", _finish(model, source.name), safe_formats.ONNX,
        {"weight_type": "QInt8", "per_channel": True, "activations": "dynamic (per batch)"},
        notes=("activation scales are computed per batch: outputs depend slightly on batch composition",),
    )  # fmt: skip


def _reader(name: str, rows: np.ndarray, batch: int = 32):
    """A CalibrationDataReader feeding ``rows`` in batches."""
    from onnxruntime.quantization import CalibrationDataReader

    class Rows(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{name: np.ascontiguousarray(rows[i : i + batch], dtype=np.float32)} for i in range(0, len(rows), batch)])

        def get_next(self):
            return next(self._it, None)

    return Rows()


def _feeds_reader(feeds: Sequence[Mapping[str, np.ndarray]]):
    """A CalibrationDataReader replaying prepared feed dicts (multi-input graphs)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{k: np.ascontiguousarray(v) for k, v in f.items()} for f in feeds])

        def get_next(self):
            return next(self._it, None)

    return Feeds()


def int8_static(source: Source) -> Candidate:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    _require_onnx(source, "int8-static")
    feeds = source.calibration_feeds
    if not feeds and (source.calibration is None or len(source.calibration) == 0):
        raise Skipped("int8-static", "needs calibration rows: the version's validation set or --calibration FILE")
    import onnx

    if feeds:
        reader = _feeds_reader(feeds)
        digest = hashlib.sha256()
        for f in feeds:
            for key in sorted(f):
                digest.update(key.encode() + np.ascontiguousarray(f[key]).tobytes())
        n_rows, calibration_sha = sum(len(next(iter(f.values()))) for f in feeds), digest.hexdigest()
    else:
        rows = np.ascontiguousarray(source.calibration, dtype=np.float32)
        reader = _reader(source.input_name, rows)
        n_rows, calibration_sha = int(len(rows)), hashlib.sha256(rows.tobytes()).hexdigest()
    with tempfile.TemporaryDirectory() as tmp, _scratch_cwd(tmp):
        pre = _preprocessed(source, Path(tmp))
        out = Path(tmp) / "int8_qdq.onnx"
        quantize_static(
            str(pre), str(out), reader, quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax,
        )  # fmt: skip
        model = onnx.load(str(out))
    params = {
        "format": "QDQ", "per_channel": True, "activation_type": "QUInt8", "weight_type": "QInt8",
        "calibration": "MinMax", "calibration_rows": int(n_rows), "calibration_sha256": calibration_sha,
    }  # fmt: skip
    return Candidate("int8-static", _finish(model, source.name), safe_formats.ONNX, params)


def int4_eligible(model, block_size: int = INT4_BLOCK) -> list[str]:
    """Names of MatMul nodes with a constant 2-D weight whose K (rows) is a multiple of ``block_size``."""
    weights = {i.name: list(i.dims) for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2:
            continue
        dims = weights.get(node.input[1])
        if dims is not None and len(dims) == 2 and dims[0] >= block_size and dims[0] % block_size == 0:
            out.append(node.name)
    return out


def int4(source: Source, block_size: int = INT4_BLOCK) -> Candidate:
    _require_onnx(source, "int4")
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as err:  # onnx_ir is an optional dependency of the quantizer
        raise Skipped("int4", f"the MatMulNBits quantizer cannot be imported ({err}); pip install onnx-ir") from None
    model = _load(source.artifact)
    _name_nodes(model)
    eligible = int4_eligible(model, block_size)
    if not eligible:
        raise Skipped("int4", f"no MatMul with a constant weight whose K is a multiple of {block_size}")
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=True, accuracy_level=4, nodes_to_include=eligible)
    quantizer.process()
    out = quantizer.model.model
    return Candidate(
        "int4", _finish(out, source.name), safe_formats.ONNX,
        {"bits": 4, "block_size": block_size, "symmetric": True, "accuracy_level": 4, "op": "MatMulNBits", "matmuls": len(eligible)},
        notes=("weight-only: activations stay float32; MatMulNBits is an ONNX Runtime contrib op",),
    )  # fmt: skip


def _single_output(model, name: str, dims: Sequence[int]) -> None:
    """Reduce a converted tree graph to one float output ``name`` shaped ``[N, *dims]``.

    Classifiers give ``label`` (int64) and ``probabilities`` ``[N, classes]``; a signature with one
    output column keeps the positive class (column 1), matching XGBoost/LightGBM ``predict``.
    """
    from onnx import TensorProto, helper

    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", TREE_OPSET))
    outputs = {o.name: o for o in model.graph.output}
    width = int(dims[0]) if dims else 1
    if "probabilities" in outputs:
        source = "probabilities"
        if width == 1:
            starts = helper.make_tensor("slice_starts", TensorProto.INT64, [1], [1])
            ends = helper.make_tensor("slice_ends", TensorProto.INT64, [1], [2])
            axes = helper.make_tensor("slice_axes", TensorProto.INT64, [1], [1])
            model.graph.initializer.extend([starts, ends, axes])
            model.graph.node.append(helper.make_node("Slice", [source, "slice_starts", "slice_ends", "slice_axes"], ["positive"], name="positive_class"))
            source = "positive"
    else:
        floats = [o.name for o in model.graph.output if o.type.tensor_type.elem_type == TensorProto.FLOAT]
        if not floats:
            raise RuntimeError(f"the converted graph has no float output ({list(outputs)})")
        source = floats[0]
    model.graph.node.append(helper.make_node("Identity", [source], [name], name="output"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", *[int(d) for d in dims]]))


def tree_onnx(source: Source) -> Candidate:
    from onnxmltools.convert.common.data_types import FloatTensorType

    if source.format not in TREE_FORMATS:
        raise Skipped("tree-onnx", f"applies to XGBoost / LightGBM models, not {source.format}")
    n_features = int(np.prod(source.input_dims))
    types = [(source.input_name, FloatTensorType([None, n_features]))]
    if source.format == safe_formats.LIGHTGBM_TEXT:
        import lightgbm as lgb
        from onnxmltools import convert_lightgbm

        booster = lgb.Booster(model_str=source.artifact.decode("utf-8"))
        model = convert_lightgbm(booster, initial_types=types, target_opset=TREE_OPSET, zipmap=False)
        params: dict[str, Any] = {"converter": "onnxmltools.convert_lightgbm", "trees": int(booster.num_trees())}
    else:
        import xgboost as xgb
        from onnxmltools import convert_xgboost

        booster = xgb.Booster()
        booster.load_model(bytearray(source.artifact))
        model = convert_xgboost(booster, initial_types=types, target_opset=TREE_OPSET)
        objective = json.loads(booster.save_config())["learner"]["objective"]["name"]
        params = {"converter": "onnxmltools.convert_xgboost", "trees": int(booster.num_boosted_rounds()), "objective": objective}
    _single_output(model, source.output_name, source.output_dims)
    params.update({"opset": TREE_OPSET, "op": "TreeEnsemble (ai.onnx.ml)", "runtime": "onnxruntime"})
    return Candidate(
        "tree-onnx", _finish(model, source.name), safe_formats.ONNX, params,
        notes=("thresholds compared in float32 (LightGBM trains double thresholds: rare boundary rows may differ)",),
    )  # fmt: skip


def tensorrt(source: Source) -> Candidate:
    from optimizer import tensorrt as trt_support

    if source.format in TREE_FORMATS:
        raise Skipped("tensorrt", "TensorRT has no tree-ensemble layers (serve trees on GPUs with Triton's FIL backend)")
    _require_onnx(source, "tensorrt")
    why = trt_support.unavailable()
    if why:
        raise Skipped("tensorrt", why)
    plan = trt_support.build_plan(source.artifact, source.input_name, source.input_dims, source.max_batch)
    return Candidate(
        "tensorrt", plan, safe_formats.TENSORRT_PLAN,
        {"precision": "fp16+fp32", "min_batch": 1, "max_batch": source.max_batch}, target="gpu",
        notes=("a plan runs only on the GPU model and TensorRT version it was built with",),
    )  # fmt: skip


_FUNCTIONS: dict[str, Callable[[Source], Candidate]] = {
    "graph": graph, "fp16": fp16, "int8-dynamic": int8_dynamic, "int8-static": int8_static,
    "int4": int4, "tree-onnx": tree_onnx, "tensorrt": tensorrt,
}  # fmt: skip


def apply(recipe: str, source: Source) -> Candidate:
    """Run one recipe; raises Skipped when it does not apply."""
    if recipe not in _FUNCTIONS:
        raise ValueError(f"unknown recipe {recipe!r} (one of {', '.join(RECIPES)})")
    return _FUNCTIONS[recipe](source)


def select(requested: Sequence[str], all_: bool, fmt: str, artifact: bytes) -> tuple[list[str], dict[str, str]]:
    """(recipes to run, recipes skipped up front with why) for a parent of format ``fmt``.

    ``--all`` means every recipe that fits the model: for ONNX graph, fp16, int8 dynamic and
    static, int4 (transformer graphs only) and tensorrt; for trees tree-onnx and tensorrt (which
    then says why it cannot). Explicitly requested recipes always run (or say why they skip).
    """
    chosen = list(dict.fromkeys(requested))
    skipped: dict[str, str] = {}
    if all_:
        if fmt == safe_formats.ONNX:
            for r in ONNX_RECIPES:
                if r == "int4" and r not in chosen and not is_transformer(artifact):
                    skipped[r] = "not a transformer graph (pass --int4 to force it)"
                    continue
                chosen.append(r)
        elif fmt in TREE_FORMATS:
            chosen += ["tree-onnx", "tensorrt"]
    chosen = [r for r in dict.fromkeys(chosen)]
    return [r for r in RECIPES if r in chosen], skipped
