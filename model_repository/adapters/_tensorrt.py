"""Run a TensorRT engine plan on the GPU (TensorRT 10 Python API, torch's CUDA memory).

Shared by the optimizer's accuracy gate (optimizer/tensorrt.py) and the Python-backend plan adapter
(tensorrt_runtime.py), which the deployer copies beside it where a Triton has a GPU but not the
native ``tensorrt`` backend. ``tensorrt`` and ``torch`` are GPU-only dependencies, imported when a
plan is run, never at import time of this module.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def plan_predictor(plan: bytes) -> Callable[[np.ndarray], np.ndarray]:
    """Run a plan on the GPU: rows (FP32) -> the first output (FP32), through torch's CUDA memory."""
    import tensorrt as trt
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError("TensorRT cannot deserialize the plan (built for another GPU or TensorRT version?)")
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
