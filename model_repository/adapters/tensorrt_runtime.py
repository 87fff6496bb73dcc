"""Triton Python-backend model: a TensorRT engine plan on the GPU, one execution per batch.

Used where a Triton has a GPU but not the native ``tensorrt`` backend (the pytriton wheel ships only
``python``); with the native backend the deployer writes ``platform: tensorrt_plan`` instead.
"""

import triton_python_backend_utils as pb_utils

from _common import AdapterSettings, execute_batched
from _tensorrt import plan_predictor


class TritonPythonModel:
    def initialize(self, args):
        self.settings = AdapterSettings(args)
        self.predict = plan_predictor(self.settings.artifact.read_bytes())

    def execute(self, requests):
        return execute_batched(requests, pb_utils, self.settings, self.predict)

    def finalize(self):
        self.predict = None
