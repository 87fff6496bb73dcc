"""Triton Python-backend model: one built-in operator of a composite endpoint (``_composite_ops``).

Its config names the operator (parameter ``op``) and its parameters (``params``, JSON); inputs
are ``in0`` … ``in{n-1}`` (optional ones may be absent: an aggregator under a quorum policy gets
the members that answered), the output is ``output``. Each request of a batch is answered alone.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from _common import BadInput, answer_each
from _composite_ops import OUTPUT, OperatorError, input_name, run


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.op = params["op"]
        self.params = json.loads(params.get("params") or "{}")
        self.inputs = len(config["input"])
        self.output_dtype = pb_utils.triton_string_to_numpy(config["output"][0]["data_type"])

    def execute(self, requests):
        def parse(request):
            inputs = {}
            for position in range(self.inputs):
                tensor = pb_utils.get_input_tensor_by_name(request, input_name(position))
                if tensor is not None:
                    inputs[position] = tensor.as_numpy()
            if not inputs:
                raise BadInput("no inputs")
            return inputs

        def compute(items):
            out = []
            for inputs in items:
                try:
                    out.append(np.ascontiguousarray(run(self.op, inputs, self.params), dtype=self.output_dtype))
                except OperatorError as err:
                    raise BadInput(str(err)) from None
            return out

        def respond(result):
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT, result)])

        return answer_each(requests, pb_utils, parse, compute, respond)
