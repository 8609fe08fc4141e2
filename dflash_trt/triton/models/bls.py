"""Triton Python model `tensorrt_llm_bls` (decoupled): tokenize, stream from `tensorrt_llm`, detokenize.

`execute` is a coroutine, so one instance streams many requests at once while each awaits `tensorrt_llm`: a few
light instances, not one stub per batch slot. The python backend's response iterator blocks, so each request waits
for its next response in a thread of a pool as wide as the batch. Runs inside Triton's Python backend; all logic
lives in `dflash_processing.py` next to this file.
"""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

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
        slots = max(1, int(json.loads(args["model_config"])["max_batch_size"]))
        self.waiters = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="bls-stream")

    async def execute(self, requests):
        await asyncio.gather(*(self._answer(request) for request in requests))
        return None

    async def _answer(self, request):
        # The final flag rides on a response (an empty one after the text), never alone: clients that did not ask
        # for empty final responses (the aio gRPC client among them) would otherwise never see the stream end.
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            await self._serve(request, sender)
        except ValueError as exc:
            error = pb_utils.TritonError(str(exc))
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=final)
            return
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=final)

    async def _serve(self, request, sender):
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
        responses = await llm_request.async_exec(decoupled=True)
        loop = asyncio.get_running_loop()
        while (response := await loop.run_in_executor(self.waiters, next, responses, None)) is not None:
            if response.has_error():
                raise ValueError(response.error().message())
            outputs = {}
            for name in (LLM_OUTPUT_IDS, LLM_SEQUENCE_LENGTH, *SPEC_METRICS):
                tensor = pb_utils.get_output_tensor_by_name(response, name)
                if tensor is not None:
                    outputs[name] = tensor.as_numpy()
            self._send(sender, session.on_engine_response(outputs))
        self._send(sender, session.finish())

    def finalize(self):
        self.waiters.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _send(sender, outputs):
        if outputs:
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
