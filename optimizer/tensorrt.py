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


def plan_predictor(plan: bytes) -> Callable[[np.ndarray], np.ndarray]:
    """Run a plan on the GPU: rows (FP32) -> the first output (FP32), through torch's CUDA memory."""
    import tensorrt as trt
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def run(rows: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).cuda()
        context.set_input_shape(inputs[0], tuple(x.shape))
        context.set_tensor_address(inputs[0], x.data_ptr())
        held = {}
        for name in outputs:
            shape = tuple(context.get_tensor_shape(name))
            held[name] = torch.empty(shape, dtype=torch.float32, device="cuda")
            context.set_tensor_address(name, held[name].data_ptr())
        stream = torch.cuda.Stream()
        context.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        return held[outputs[0]].cpu().numpy()

    return run
