"""Triton Python-backend model: an ONNX graph on ONNX Runtime, one session call per batch.

The execution providers come from the config's ``providers`` parameter (best first, written by
``server.control.registry.backend_configs``: CUDA / TensorRT on a GPU, CPU otherwise). A provider the config
asks for that this onnxruntime lacks fails the load with its name, never a silent fall-back to CPU.
"""

import onnxruntime as ort
import triton_python_backend_utils as pb_utils

from _common import AdapterSettings, execute_batched, session_providers


class TritonPythonModel:
    def initialize(self, args):
        self.settings = AdapterSettings(args)
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.settings.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        providers = session_providers(self.settings.parameters.get("providers", ""), ort.get_available_providers())
        self.session = ort.InferenceSession(str(self.settings.artifact), sess_options=options, providers=providers)
        self.graph_input = self.session.get_inputs()[0].name
        self.graph_output = self.session.get_outputs()[0].name

    def _predict(self, batch):
        return self.session.run([self.graph_output], {self.graph_input: batch})[0]

    def execute(self, requests):
        return execute_batched(requests, pb_utils, self.settings, self._predict)

    def finalize(self):
        self.session = None
