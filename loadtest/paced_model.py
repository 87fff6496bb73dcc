"""A benchmark-only Triton model whose service time is a pause, not CPU work.

The fairness and overload benchmarks need a model that saturates before the frontend does:
on this 2-core machine the load generator, the frontend and Triton share the CPUs, so a CPU-bound
model's capacity is whatever CPU the other two leave it, and "5x capacity" would measure CPU
contention rather than admission policy. ``paced`` stands in for an accelerator: each of
``instances`` Triton instances answers one request at a time after a pause of ``service_ms``
on average (sleeping, so the CPU stays free), giving a known capacity of ``instances /
service_ms`` requests per second. ``jitter`` spreads each pause uniformly over
``service_ms x [1 - jitter, 1 + jitter]`` as real service times vary; with ``jitter 0`` the
instances of a saturated model finish in lockstep (all slots free at once, once per service
time). Inputs ``features`` FP32 ``[rows, 8]``; output ``score`` FP32 ``[rows, 1]`` (row sums,
so answers are checkable). Never part of the demo repository.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NAME = "paced"
FEATURES = 8

MODEL_PY = '''\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.pause = float(params["service_ms"]["string_value"]) / 1000.0
        self.jitter = float(params["jitter"]["string_value"])
        self.rng = np.random.default_rng(sum(args["model_instance_name"].encode()))

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "features").as_numpy()
            time.sleep(self.pause * (1.0 + self.jitter * (2.0 * self.rng.random() - 1.0)))
            score = x.astype(np.float32).sum(axis=-1, keepdims=True)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("score", score)]))
        return responses
'''


def build_paced_model(out: Path, service_ms: float, instances: int, jitter: float = 0.0, name: str = NAME) -> Path:
    """Write ``out/NAME`` (config + Python model): capacity ``instances * 1000 / service_ms`` req/s."""
    from model_repository.config_writer import write_config
    from server.protogen.inference import model_config_pb2 as mc

    model_dir = Path(out) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.py").write_text(MODEL_PY, encoding="utf-8")
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.input.add(name="features", data_type=mc.TYPE_FP32, dims=[-1, FEATURES])
    config.output.add(name="score", data_type=mc.TYPE_FP32, dims=[-1, 1])
    config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances)
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    config.parameters["service_ms"].string_value = f"{service_ms:g}"
    config.parameters["jitter"].string_value = f"{jitter:g}"
    write_config(config, model_dir)
    return model_dir


def sample_features(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, FEATURES)).astype(np.float32)
