"""Triton Python-backend model: sentence embeddings (tokenize -> ONNX Runtime), one session call per batch.

Input ``text`` (BYTES, one string per row); outputs ``embedding`` (FP32 ``[dim]``, already
mean-pooled and L2-normalized by the graph) and ``tokens`` (INT32 ``[1]``, tokens per row).
A text model with another head (the safety classifier: ``probabilities`` FP32 ``[labels]``) runs
here too: the graph's output is the config's first output that is not ``tokens``, and ``tokens``
is answered only when the config declares it.
The dynamic batcher hands several requests to ``execute``; their rows are tokenized together
(padded to the longest row), run in one ``session.run`` and cut back per request. A request
whose text is not UTF-8 gets its own INVALID_ARG error; the others in the batch still answer
(``_common.answer_each``).
"""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from _common import ArtifactMismatch, BadInput, answer_each, verify_artifact


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
        head = next(o for o in config["output"] if o["name"] != "tokens")
        self.output, self.dim = head["name"], int(head["dims"][0])
        self.with_tokens = any(o["name"] == "tokens" for o in config["output"])

    def execute(self, requests):
        return answer_each(requests, pb_utils, self._texts, self._embed, self._respond)

    @staticmethod
    def _texts(request):
        """One request's rows as text; a row that is not UTF-8 is this request's mistake alone."""
        tensor = pb_utils.get_input_tensor_by_name(request, "text")
        if tensor is None:
            raise BadInput("input 'text' is missing")
        rows = tensor.as_numpy().reshape(-1)
        texts = []
        for i, row in enumerate(rows):
            if isinstance(row, bytes):
                try:
                    row = row.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise BadInput(f"input 'text' row {i} is not valid UTF-8 (byte {err.start})") from None
            texts.append(str(row))
        return texts

    def _embed(self, groups):
        """One tokenizer pass and one session run over every request's rows; cut back per request."""
        texts = [t for group in groups for t in group]
        if not texts:
            return [(np.zeros((0, self.dim), np.float32), np.zeros((0, 1), np.int32)) for _ in groups]
        encodings = self.tokenizer.encode_batch(texts)
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        feeds = {k: v for k, v in feeds.items() if k in self.graph_inputs}
        embedding = self.session.run([self.output], feeds)[0].astype(np.float32)
        tokens = feeds["attention_mask"].sum(axis=1).astype(np.int32).reshape(-1, 1)
        if embedding.shape[0] != len(texts):
            raise RuntimeError(f"the graph answered {embedding.shape[0]} rows for {len(texts)} texts")
        out, start = [], 0
        for group in groups:
            n = len(group)
            out.append((embedding[start : start + n], tokens[start : start + n]))
            start += n
        return out

    def _respond(self, result):
        embedding, tokens = result
        tensors = [pb_utils.Tensor(self.output, embedding)]
        if self.with_tokens:
            tensors.append(pb_utils.Tensor("tokens", tokens))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.session = None
