"""Triton Python-backend model: sentence embeddings (tokenize -> ONNX Runtime), one session call per batch.

Input ``text`` (BYTES, one string per row); outputs ``embedding`` (FP32 ``[dim]``, already
mean-pooled and L2-normalized by the graph) and ``tokens`` (INT32 ``[1]``, tokens per row).
The dynamic batcher hands several requests to ``execute``; their rows are tokenized together
(padded to the longest row), run in one ``session.run`` and cut back per request.
"""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from _common import ArtifactMismatch, verify_artifact


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        artifact = version_dir / Path(params.get("artifact", "model.onnx")).name
        try:
            verify_artifact(artifact, params.get("artifact_sha256", ""))
        except ArtifactMismatch as err:
            raise pb_utils.TritonModelException(str(err)) from None
        max_length = int(params.get("max_length") or 256)
        self.tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.enable_padding(pad_id=self.tokenizer.token_to_id("[PAD]") or 0, pad_token="[PAD]")
        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, int(params.get("threads") or 1))
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(artifact), sess_options=options, providers=["CPUExecutionProvider"])
        self.graph_inputs = {i.name for i in self.session.get_inputs()}

    def execute(self, requests):
        try:
            texts, counts = [], []
            for request in requests:
                rows = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
                counts.append(len(rows))
                texts.extend(r.decode("utf-8") if isinstance(r, bytes) else str(r) for r in rows)
            encodings = self.tokenizer.encode_batch(texts)
            feeds = {
                "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
            }
            feeds = {k: v for k, v in feeds.items() if k in self.graph_inputs}
            embedding = self.session.run(["embedding"], feeds)[0].astype(np.float32)
            tokens = feeds["attention_mask"].sum(axis=1).astype(np.int32).reshape(-1, 1)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the model down
            error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
            return [pb_utils.InferenceResponse(output_tensors=[], error=error) for _ in requests]
        responses, start = [], 0
        for n in counts:
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("embedding", embedding[start : start + n]),
                        pb_utils.Tensor("tokens", tokens[start : start + n]),
                    ]
                )
            )
            start += n
        return responses

    def finalize(self):
        self.session = None
