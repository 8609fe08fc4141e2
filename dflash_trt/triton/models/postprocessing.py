"""Triton Python model `postprocessing`: engine output ids -> text.

Runs inside Triton's Python backend; all logic lives in `dflash_processing.py` next to this file.
"""

import triton_python_backend_utils as pb_utils
from dflash_processing import SEQUENCE_LENGTH, TOKENS_BATCH, Postprocessor, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args["model_config"])
        self.postprocessor = Postprocessor.from_dir(
            params["tokenizer_dir"], skip_special_tokens=params["skip_special_tokens"] == "true"
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {
                name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in (TOKENS_BATCH, SEQUENCE_LENGTH)
            }
            outputs = self.postprocessor.postprocess(inputs, request.request_id())
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
