"""TensorRT engine plans: built only where an NVIDIA GPU and the ``tensorrt`` package are present.

``unavailable()`` says in words why a plan cannot be built here (no GPU device, no driver, no
``tensorrt`` package, no CUDA-enabled torch to run the plan for the accuracy gate); the recipe
turns that into a visible "skipped" row, never a silent no-op. The build path targets the
TensorRT 10 Python API (``build_serialized_network``, named I/O tensors, ``execute_async_v3``); it
has not run on this project's CPU-only machines.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Sequence

import numpy as np

from model_repository.adapters._tensorrt import plan_predictor  # noqa: F401 - the runner the plan adapter uses too


def unavailable() -> str:
    """'' when a plan can be built and checked here; otherwise why not."""
    if not (os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")):
        return "no NVIDIA GPU on this machine (no /dev/nvidia* device)"
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA driver tools (nvidia-smi not found)"
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed (pip install tensorrt-cu12)"
    try:
        import torch
    except ImportError:
        return "torch with CUDA is needed to run the plan for the accuracy gate and is not installed"
    if not torch.cuda.is_available():
        return "torch cannot see a CUDA device (CPU-only build or driver mismatch)"
    return ""


def build_plan(onnx_bytes: bytes, input_name: str, input_dims: Sequence[int], max_batch: int, fp16: bool = True) -> bytes:
    """A serialized engine for batch sizes 1..max_batch (optimized for max_batch / 2)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse the ONNX graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    if fp16 and builder.platform_has_fast_fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    dims = [int(d) for d in input_dims]
    best = max(1, max_batch // 2)
    profile.set_shape(input_name, (1, *dims), (best, *dims), (max(1, max_batch), *dims))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build an engine (see its log above)")
    return bytes(plan)
