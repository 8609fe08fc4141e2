"""Tokenizer work of the DFlash Triton repository: text -> engine inputs and engine outputs -> text.

This file is copied next to the Triton Python models (as `dflash_processing.py`, and `dflash_trt.sampling_rules` as
`dflash_sampling_rules.py`), so it imports neither Triton nor the rest of dflash_trt: the `model.py` files only move
numpy arrays between Triton and the functions here, and the tests run these functions with a real tokenizer on CPU.
The tensor names of every model in the repository, and how a request's tensors flow between them, are defined here,
once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

try:
    from dflash_trt.chat import encode_chat, parse_template_kwargs
    from dflash_trt.sampling_rules import effective_temperature, sampling_refusal
except ImportError:  # inside Triton, where dflash_trt need not be installed: the copies next to this file
    from dflash_chat import encode_chat, parse_template_kwargs  # type: ignore[no-redef]
    from dflash_sampling_rules import effective_temperature, sampling_refusal  # type: ignore[no-redef]

# preprocessing model
QUERY = "QUERY"
REQUEST_OUTPUT_LEN = "REQUEST_OUTPUT_LEN"
TEMPERATURE = "TEMPERATURE"
END_ID = "END_ID"
PAD_ID = "PAD_ID"
STOP_WORDS = "STOP_WORDS"
BAD_WORDS = "BAD_WORDS"
INPUT_ID = "INPUT_ID"
REQUEST_INPUT_LEN = "REQUEST_INPUT_LEN"
OUT_REQUEST_OUTPUT_LEN = "OUT_REQUEST_OUTPUT_LEN"
STOP_WORDS_IDS = "STOP_WORDS_IDS"
BAD_WORDS_IDS = "BAD_WORDS_IDS"
OUT_END_ID = "OUT_END_ID"
OUT_PAD_ID = "OUT_PAD_ID"
OUT_TEMPERATURE = "OUT_TEMPERATURE"
# Sampling parameters a client may send (the names of TensorRT-LLM's Triton ensembles), each an optional [1] input
# of `ensemble`, `tensorrt_llm_bls` and `preprocessing`, which refuses any value the engine would silently ignore.
SAMPLING_INPUTS = {
    "top_k": "TYPE_INT32",
    "top_p": "TYPE_FP32",
    "repetition_penalty": "TYPE_FP32",
    "presence_penalty": "TYPE_FP32",
    "frequency_penalty": "TYPE_FP32",
    "length_penalty": "TYPE_FP32",
    "min_tokens": "TYPE_INT32",
    "beam_width": "TYPE_INT32",
    "num_return_sequences": "TYPE_INT32",
}
# postprocessing model
TOKENS_BATCH = "TOKENS_BATCH"
SEQUENCE_LENGTH = "SEQUENCE_LENGTH"
OUTPUT = "OUTPUT"
# tensorrt_llm model: the names TensorRT-LLM's C++ backend reads and writes
LLM_INPUT_IDS = "input_ids"
LLM_INPUT_LENGTHS = "input_lengths"
LLM_REQUEST_OUTPUT_LEN = "request_output_len"
LLM_END_ID = "end_id"
LLM_PAD_ID = "pad_id"
LLM_STOP_WORDS = "stop_words_list"
LLM_BAD_WORDS = "bad_words_list"
LLM_TEMPERATURE = "temperature"
LLM_RANDOM_SEED = "random_seed"
LLM_STREAMING = "streaming"
LLM_STOP = "stop"
LLM_RETURN_PERF_METRICS = "return_perf_metrics"
LLM_OUTPUT_IDS = "output_ids"
LLM_SEQUENCE_LENGTH = "sequence_length"
SPEC_METRICS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
# what clients send to `ensemble` and `tensorrt_llm_bls`, and get back
TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
STREAM = "stream"
REQUEST_TEMPERATURE = "temperature"
REQUEST_RANDOM_SEED = "random_seed"
REQUEST_END_ID = "end_id"
REQUEST_PAD_ID = "pad_id"
REQUEST_STOP_WORDS = "stop_words"
REQUEST_BAD_WORDS = "bad_words"
REQUEST_PERF_METRICS = "return_perf_metrics"
TEXT_OUTPUT = "text_output"

# Request tensor -> preprocessing input.
REQUEST_TO_PRE = {
    TEXT_INPUT: QUERY,
    MAX_TOKENS: REQUEST_OUTPUT_LEN,
    REQUEST_TEMPERATURE: TEMPERATURE,
    REQUEST_END_ID: END_ID,
    REQUEST_PAD_ID: PAD_ID,
    REQUEST_STOP_WORDS: STOP_WORDS,
    REQUEST_BAD_WORDS: BAD_WORDS,
    **{name: name for name in SAMPLING_INPUTS},
}
# Preprocessing output -> tensorrt_llm input.
PRE_TO_LLM = {
    INPUT_ID: LLM_INPUT_IDS,
    REQUEST_INPUT_LEN: LLM_INPUT_LENGTHS,
    OUT_REQUEST_OUTPUT_LEN: LLM_REQUEST_OUTPUT_LEN,
    STOP_WORDS_IDS: LLM_STOP_WORDS,
    BAD_WORDS_IDS: LLM_BAD_WORDS,
    OUT_END_ID: LLM_END_ID,
    OUT_PAD_ID: LLM_PAD_ID,
    OUT_TEMPERATURE: LLM_TEMPERATURE,
}
# Request tensor passed to tensorrt_llm unchanged.
REQUEST_TO_LLM = {
    REQUEST_RANDOM_SEED: LLM_RANDOM_SEED,
    STREAM: LLM_STREAMING,
    REQUEST_PERF_METRICS: LLM_RETURN_PERF_METRICS,
}


def load_tokenizer(tokenizer_dir: str):
    """A local tokenizer only: no hub access and never code from the directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True, trust_remote_code=False)


def generation_eos_ids(tokenizer_dir: str) -> list[int]:
    """Every end-of-sequence id the model's generation_config.json declares (Llama 3.1 has three)."""
    path = Path(tokenizer_dir) / "generation_config.json"
    if not path.is_file():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def texts(array: np.ndarray) -> list[list[str]]:
    """A Triton STRING tensor [batch, n] (bytes or str objects) as Python strings, one list per request."""
    rows = np.asarray(array, dtype=object).reshape(len(array), -1)
    return [[v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in row] for row in rows]


def word_list(token_words: list[list[list[int]]]) -> np.ndarray:
    """TensorRT-LLM's stop/bad word format, [batch, 2, L] int32: row 0 holds the words' token ids back to back,
    row 1 the end offset of each word, padded with 0 and -1; a request without words gets no offsets."""
    flat = [[t for word in words for t in word] for words in token_words]
    ends = [np.cumsum([len(word) for word in words]).tolist() for words in token_words]
    width = max(1, *(len(f) for f in flat))
    out = np.zeros((len(token_words), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, (ids, offsets) in enumerate(zip(flat, ends, strict=True)):
        out[i, 0, : len(ids)] = ids
        out[i, 1, : len(offsets)] = offsets
    return out


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def model_parameters(model_config_json: str) -> dict[str, str]:
    """The string parameters of a model's config, from the JSON Triton's Python backend hands to `initialize`."""
    config = json.loads(model_config_json)
    return {key: value["string_value"] for key, value in config["parameters"].items()}


class Preprocessor:
    """Request text and options -> the `tensorrt_llm` model's inputs, refusing what the engine cannot honour."""

    def __init__(
        self,
        tokenizer,
        *,
        add_special_tokens: bool,
        max_input_len: int,
        max_seq_len: int,
        max_temperature: float,
        extra_stop_ids: Sequence[int] = (),
        chat_template_kwargs: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self.add_special_tokens = add_special_tokens
        self.max_input_len = max_input_len
        self.max_seq_len = max_seq_len
        self.max_temperature = max_temperature
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer defines no eos token; cannot choose the engine's end_id")
        self.end_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else self.end_id
        self.extra_stop_ids = [i for i in extra_stop_ids if i != self.end_id]

    @classmethod
    def from_dir(cls, tokenizer_dir: str, **kwargs) -> Preprocessor:
        return cls(load_tokenizer(tokenizer_dir), extra_stop_ids=generation_eos_ids(tokenizer_dir), **kwargs)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> Preprocessor:
        """From the string parameters our config.pbtxt gives the preprocessing and BLS models."""
        return cls.from_dir(
            params["tokenizer_dir"],
            add_special_tokens=params["add_special_tokens"] == "true",
            max_input_len=int(params["max_input_len"]),
            max_seq_len=int(params["max_seq_len"]),
            max_temperature=float(params["max_temperature"]),
            chat_template_kwargs=parse_template_kwargs(params.get("chat_template_kwargs") or "{}"),
        )

    def check_sampling(self, inputs: dict[str, np.ndarray], batch: int) -> np.ndarray:
        """Each request's temperature (0 when not sent: greedy, never the runtime's default of 1), after refusing
        any sampling parameter or bad word the engine cannot honour."""
        temperature = inputs.get(TEMPERATURE)
        temperature = (
            np.zeros((batch, 1), np.float32)
            if temperature is None
            else np.asarray(temperature, dtype=np.float32).reshape(batch, 1)
        )
        bad_words = texts(inputs[BAD_WORDS]) if inputs.get(BAD_WORDS) is not None else [[] for _ in range(batch)]
        for row in range(batch):
            params = {
                name: np.asarray(inputs[name]).reshape(batch)[row].item()
                for name in SAMPLING_INPUTS
                if inputs.get(name) is not None
            }
            params["bad_words"] = bad_words[row]
            refusal = sampling_refusal({"temperature": float(temperature[row, 0]), **params})
            if refusal is not None:
                raise ValueError(refusal)
        worst = max(effective_temperature(float(t)) for t in temperature.reshape(-1))
        if worst > self.max_temperature:
            raise ValueError(
                f"temperature {worst:g} refused: this DFlash engine verifies drafts greedily, so a sampling "
                f"request would silently decode greedily; send temperature <= {self.max_temperature:g} "
                "(0 means greedy)"
            )
        return temperature

    def _query_ids(self, query: str) -> list[int]:
        """A query that is a JSON object with "messages" is a chat, rendered with the tokenizer's template."""
        chat = _json_object(query) if query.lstrip().startswith("{") else None
        if chat is not None and "messages" in chat:
            return encode_chat(self.tokenizer, chat["messages"], self.chat_template_kwargs)
        return self.tokenizer.encode(query, add_special_tokens=self.add_special_tokens)

    def encode(self, queries: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [self._query_ids(q) for q in queries]
        for row in ids:
            if not row:
                raise ValueError("empty prompt: text_input must contain at least one token")
            if len(row) > self.max_input_len:
                raise ValueError(f"prompt has {len(row)} tokens; the engine accepts at most {self.max_input_len}")
        width = max(len(r) for r in ids)
        batch = np.full((len(ids), width), self.pad_id, dtype=np.int32)
        for i, row in enumerate(ids):
            batch[i, : len(row)] = row
        return batch, np.array([[len(r)] for r in ids], dtype=np.int32)

    def check_lengths(self, input_len: np.ndarray, output_len: np.ndarray) -> None:
        """Prompt + max_tokens within the longest request the engine holds: the runtime admits up to its KV window,
        which is longer, and the last steps of a longer request would read positions the engine does not have."""
        for prompt, budget in zip(input_len.reshape(-1).tolist(), output_len.reshape(-1).tolist(), strict=True):
            if prompt >= self.max_seq_len:
                raise ValueError(
                    f"prompt has {prompt} tokens; the engine holds requests (prompt + output) of at most "
                    f"{self.max_seq_len}"
                )
            if prompt + budget > self.max_seq_len:
                raise ValueError(
                    f"prompt ({prompt} tokens) + max_tokens ({budget}) = {prompt + budget} exceeds the longest "
                    f"request the engine holds ({self.max_seq_len}); send max_tokens <= {self.max_seq_len - prompt}"
                )

    def _words(self, array: np.ndarray | None, batch: int, with_eos: bool) -> np.ndarray:
        words = texts(array) if array is not None else [[] for _ in range(batch)]
        tokens = [
            [self.tokenizer.encode(w, add_special_tokens=False) for w in request if w]
            + ([[i] for i in self.extra_stop_ids] if with_eos else [])
            for request in words
        ]
        return word_list(tokens)

    def preprocess(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Triton input tensors by name -> output tensors by name; raises ValueError with the user's message."""
        queries = [row[0] for row in texts(inputs[QUERY])]
        temperature = self.check_sampling(inputs, len(queries))
        output_len = np.asarray(inputs[REQUEST_OUTPUT_LEN], dtype=np.int32).reshape(-1, 1)
        if (output_len < 1).any():
            raise ValueError("max_tokens must be at least 1")
        input_ids, input_len = self.encode(queries)
        self.check_lengths(input_len, output_len)
        batch = len(queries)
        end_id = inputs.get(END_ID)
        pad_id = inputs.get(PAD_ID)
        return {
            INPUT_ID: input_ids,
            REQUEST_INPUT_LEN: input_len,
            OUT_REQUEST_OUTPUT_LEN: output_len,
            STOP_WORDS_IDS: self._words(inputs.get(STOP_WORDS), batch, with_eos=True),
            BAD_WORDS_IDS: self._words(inputs.get(BAD_WORDS), batch, with_eos=False),
            OUT_END_ID: (
                np.asarray(end_id, dtype=np.int32).reshape(-1, 1)
                if end_id is not None
                else np.full((batch, 1), self.end_id, dtype=np.int32)
            ),
            OUT_PAD_ID: (
                np.asarray(pad_id, dtype=np.int32).reshape(-1, 1)
                if pad_id is not None
                else np.full((batch, 1), self.pad_id, dtype=np.int32)
            ),
            OUT_TEMPERATURE: temperature,
        }


# Token ids the ensemble's postprocessing holds back per request at most: a character is at most 4 UTF-8 bytes, so
# a longer incomplete tail is not one character and is released as it decodes.
MAX_HELD_TOKENS = 8


class Postprocessor:
    """Engine output ids -> text. Each streamed response carries only its new tokens.

    The ensemble calls this model once per `tensorrt_llm` response, with no state of its own between the calls and
    no final flag, so a character whose bytes span two responses would print as two replacement characters. The
    one thing that identifies a request across those calls is the client's request id, which the ensemble copies
    onto every request it sends a composing model. With a non-empty id, the ids of an incomplete trailing character
    are held back under that id and decoded with the next response's ids. Without an id each response is decoded
    on its own. At most `max_pending` requests are held (the oldest is dropped), so a request that ends inside a
    character, or is cancelled, leaves nothing behind for long.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool, max_pending: int = 1024):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.max_pending = max_pending
        self.pending: dict[tuple[str, int, int], list[int]] = {}

    @classmethod
    def from_dir(cls, tokenizer_dir: str, **kwargs) -> Postprocessor:
        return cls(load_tokenizer(tokenizer_dir), **kwargs)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _held_back(self, key: tuple[str, int, int], ids: list[int]) -> str:
        """The text of `ids` after the ids held under `key`, less an incomplete trailing character."""
        ids = self.pending.pop(key, []) + ids
        text = self._decode(ids)
        if not text.endswith("\ufffd"):
            return text
        for cut in range(len(ids) - 1, max(-1, len(ids) - 1 - MAX_HELD_TOKENS), -1):
            head = self._decode(ids[:cut])
            if not head.endswith("\ufffd"):
                self.pending[key] = ids[cut:]
                while len(self.pending) > self.max_pending:
                    del self.pending[next(iter(self.pending))]
                return head
        return text

    def postprocess(self, inputs: dict[str, np.ndarray], request_id: str = "") -> dict[str, np.ndarray]:
        tokens = np.asarray(inputs[TOKENS_BATCH])
        lengths = np.asarray(inputs[SEQUENCE_LENGTH])
        if tokens.ndim == 2:  # [batch, L]: one beam
            tokens, lengths = tokens[:, None, :], lengths.reshape(-1, 1)
        out = np.empty(lengths.shape, dtype=object)
        for b in range(tokens.shape[0]):
            for beam in range(tokens.shape[1]):
                ids = tokens[b, beam, : int(lengths[b, beam])].tolist()
                text = self._held_back((request_id, b, beam), ids) if request_id else self._decode(ids)
                out[b, beam] = text.encode("utf-8")
        return {OUTPUT: out}


class StreamDetokenizer:
    """Text of a growing token sequence, released piece by piece without ever splitting a character: a piece
    ending in an incomplete UTF-8 sequence is held back until the tokens that complete it arrive."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.released = 0

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self._text()
        if text.endswith("\ufffd"):
            return ""
        piece, self.released = text[self.released :], len(text)
        return piece

    def flush(self) -> str:
        text = self._text()
        piece, self.released = text[self.released :], len(text)
        return piece


class BlsRequest:
    """One request through the BLS model: tensors for tensorrt_llm, then text pieces and metrics per response."""

    def __init__(self, preprocessor: Preprocessor, *, skip_special_tokens: bool):
        self.preprocessor = preprocessor
        self.detokenizer = StreamDetokenizer(preprocessor.tokenizer, skip_special_tokens=skip_special_tokens)

    def engine_inputs(self, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if len(request[TEXT_INPUT]) != 1:
            raise ValueError("tensorrt_llm_bls takes one prompt per request; send a batch through ensemble")
        pre = self.preprocessor.preprocess({REQUEST_TO_PRE[k]: v for k, v in request.items() if k in REQUEST_TO_PRE})
        inputs = {PRE_TO_LLM[name]: array for name, array in pre.items()}
        inputs.update({REQUEST_TO_LLM[k]: v for k, v in request.items() if k in REQUEST_TO_LLM})
        return inputs

    @staticmethod
    def _text(piece: str) -> dict[str, np.ndarray]:
        return {TEXT_OUTPUT: np.array([[piece.encode("utf-8")]], dtype=object)} if piece else {}

    def on_engine_response(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new text (if any) and the speculative-decoding metrics (if sent) of one tensorrt_llm response."""
        result = {}
        if outputs.get(LLM_OUTPUT_IDS) is not None:
            length = int(np.asarray(outputs[LLM_SEQUENCE_LENGTH]).reshape(-1)[0])
            ids = np.asarray(outputs[LLM_OUTPUT_IDS]).reshape(-1)[:length].tolist()
            result.update(self._text(self.detokenizer.push(ids)))
        result.update({name: outputs[name] for name in SPEC_METRICS if outputs.get(name) is not None})
        return result

    def finish(self) -> dict[str, np.ndarray]:
        return self._text(self.detokenizer.flush())
