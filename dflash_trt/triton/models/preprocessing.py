"""Triton Python model `preprocessing`: request text -> token ids for the `tensorrt_llm` model.

Runs inside Triton's Python backend; all logic lives in `dflash_processing.py` next to this file.
"""

import triton_python_backend_utils as pb_utils
from dflash_processing import (
    BAD_WORDS,
    END_ID,
    PAD_ID,
    QUERY,
    REQUEST_OUTPUT_LEN,
    SAMPLING_INPUTS,
    STOP_WORDS,
    TEMPERATURE,
    Preprocessor,
    model_parameters,
)

INPUTS = (QUERY, REQUEST_OUTPUT_LEN, TEMPERATURE, END_ID, PAD_ID, STOP_WORDS, BAD_WORDS, *SAMPLING_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args["model_config"])
        self.preprocessor = Preprocessor.from_parameters(params)

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {}
            for name in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                outputs = self.preprocessor.preprocess(inputs)
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
                continue
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
