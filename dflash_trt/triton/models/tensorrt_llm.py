"""Triton Python model `tensorrt_llm` of a CPU-served repository (decoupled): the emulated engine behind the
tensorrtllm backend's contract.

Runs inside Triton's Python backend, whose environment must have dflash_trt installed; all logic lives in
`dflash_trt.triton.emulated_llm`.
"""

import triton_python_backend_utils as pb_utils

from dflash_trt.triton.emulated_llm import INPUT_NAMES, Server
from dflash_trt.triton.processing import model_parameters


class _Sink:
    def __init__(self, sender):
        self.sender = sender

    def send(self, outputs, error, final):
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()],
            error=pb_utils.TritonError(error) if error else None,
        )
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def cancelled(self):
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        self.server = Server.from_parameters(model_parameters(args["model_config"]))

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            self.server.submit(inputs, _Sink(request.get_response_sender()))
        return None

    def finalize(self):
        self.server.stop()
