#!/usr/bin/env bash
# The GPU checks (tests/gpu/), set up and run on a machine with one NVIDIA GPU and only the package
# index reachable. Budget: under 10 minutes (most of it pip). Usage: tests/gpu/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi -L  # fails fast without a GPU and its driver
started=$(date +%s)

make .venv/.installed  # the project (PyPI's Linux torch wheel is a CUDA build)
# the CUDA builds: onnxruntime-gpu replaces onnxruntime (one import name), TensorRT 10 for the plan
.venv/bin/python -m pip uninstall -q -y onnxruntime
.venv/bin/python -m pip install -q "onnxruntime-gpu>=1.18" "tensorrt-cu12>=10"
.venv/bin/python -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers(), o.get_available_providers()"
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch cannot see the GPU'"

# vLLM in its own environment (the adapter runs its OpenAI server from there): the Makefile's target
make .venv-vllm/.installed
export INFERPLANE_VLLM_PYTHON="$PWD/.venv-vllm/bin/python"

echo "setup took $(( $(date +%s) - started )) s"
timeout 540 .venv/bin/python -m pytest tests/gpu -m gpu -v -rs -p no:cacheprovider "$@"
echo "tests/gpu/run.sh: done in $(( $(date +%s) - started )) s"
