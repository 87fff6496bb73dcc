"""tests/gpu/ is collected by the suite and, without a GPU, every test in it is skipped with its
reason — never silently passed; tests/gpu/run.sh is the one script that runs them on a GPU."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from server.control.registry.backend_configs import observe_gpus

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"
CHECKS = {"test_onnx_deploys_on_the_gpu_through_the_cuda_provider", "test_a_tensorrt_plan_built_by_the_optimizer_is_served",
          "test_gpu_metrics_are_exported", "test_vllm_on_cuda_with_tensor_parallel_1_streams_through_the_openai_api"}  # fmt: skip


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", str(GPU), "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ), timeout=300)  # fmt: skip


def test_the_gpu_checks_are_collected_marked_gpu_and_without_a_gpu_skipped_with_their_reason():
    script = (GPU / "run.sh").read_text()
    assert os.access(GPU / "run.sh", os.X_OK) and "onnxruntime-gpu" in script and "tensorrt" in script and ".venv-vllm" in script
    tree = ast.parse((GPU / "test_gpu_serving.py").read_text())
    marks = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "pytestmark"]
    assert marks and "gpu" in ast.unparse(marks[0].value)
    on_gpu = observe_gpus() > 0  # a GPU machine runs them for real (tests/gpu/run.sh): here only collect
    out = _pytest("-m", "gpu", *(["--collect-only", "-q"] if on_gpu else ["-v", "-rs"]))
    collected = {line.split("::")[-1].split()[0] for line in out.stdout.splitlines() if "test_gpu_serving.py::" in line}
    assert collected == CHECKS, out.stdout + out.stderr
    if not on_gpu:
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"{len(CHECKS)} skipped" in out.stdout and " passed" not in out.stdout and " failed" not in out.stdout
        assert f"SKIPPED [{len(CHECKS)}] tests/gpu/test_gpu_serving.py: needs an NVIDIA GPU" in out.stdout, out.stdout
