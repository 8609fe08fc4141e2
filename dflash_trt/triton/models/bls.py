"""Triton Python model `tensorrt_llm_bls` (decoupled): tokenize, stream from `tensorrt_llm`, detokenize.

Runs inside Triton's Python backend; all logic lives in `dflash_processing.py` next to this file.
"""

import numpy as np
import triton_python_backend_utils as pb_utils
from dflash_processing import (
    LLM_OUTPUT_IDS,
    LLM_SEQUENCE_LENGTH,
    REQUEST_TO_LLM,
    REQUEST_TO_PRE,
    SPEC_METRICS,
    BlsRequest,
    Preprocessor,
    model_parameters,
)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args["model_config"])
        self.preprocessor = Preprocessor.from_parameters(params)
        self.skip_special_tokens = params["skip_special_tokens"] == "true"
        self.llm_model = params["tensorrt_llm_model_name"]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._serve(request, sender)
            except ValueError as exc:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _serve(self, request, sender):
        inputs = {}
        for name in {**REQUEST_TO_PRE, **REQUEST_TO_LLM}:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        session = BlsRequest(self.preprocessor, skip_special_tokens=self.skip_special_tokens)
        llm_inputs = session.engine_inputs(inputs)
        llm_request = pb_utils.InferenceRequest(
            model_name=self.llm_model,
            inputs=[pb_utils.Tensor(name, np.ascontiguousarray(array)) for name, array in llm_inputs.items()],
            requested_output_names=[LLM_OUTPUT_IDS, LLM_SEQUENCE_LENGTH, *SPEC_METRICS],
        )
        for response in llm_request.exec(decoupled=True):
            if response.has_error():
                raise ValueError(response.error().message())
            outputs = {}
            for name in (LLM_OUTPUT_IDS, LLM_SEQUENCE_LENGTH, *SPEC_METRICS):
                tensor = pb_utils.get_output_tensor_by_name(response, name)
                if tensor is not None:
                    outputs[name] = tensor.as_numpy()
            self._send(sender, session.on_engine_response(outputs))
        self._send(sender, session.finish())

    @staticmethod
    def _send(sender, outputs):
        if outputs:
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
