"""Triton pre/post-processing round-trips a real tokenizer: prompts, stop and bad word lists, refusals, streaming."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _triton_repo import EOS, IM_END, PAD, make_preprocessor, processing_request, write_tokenizer

from dflash_trt.triton import processing as P


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def pre(tokenizer_dir: Path) -> P.Preprocessor:
    return make_preprocessor(tokenizer_dir)


def decode_word_list(row: np.ndarray) -> list[list[int]]:
    """The backend's convertWordList: the second half of the flattened [2, L] row holds end offsets until -1."""
    flat = row.reshape(-1).tolist()
    ids, offsets = flat[: len(flat) // 2], flat[len(flat) // 2 :]
    words, start = [], 0
    for end in offsets:
        if end == -1:
            break
        words.append(ids[start:end])
        start = end
    return words


def test_preprocess_tokenizes_like_the_tokenizer(pre: P.Preprocessor):
    tok = pre.tokenizer
    texts = ["the quick brown fox", "a block é"]
    out = pre.preprocess(processing_request(texts))
    expected = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert out[P.REQUEST_INPUT_LEN].tolist() == [[len(e)] for e in expected]
    for row, length, e in zip(out[P.INPUT_ID], out[P.REQUEST_INPUT_LEN][:, 0], expected, strict=True):
        assert row[:length].tolist() == e and (row[length:] == pre.pad_id).all()
    assert out[P.INPUT_ID].dtype == np.int32 and out[P.OUT_REQUEST_OUTPUT_LEN].tolist() == [[8], [8]]
    assert out[P.OUT_END_ID].tolist() == [[tok.convert_tokens_to_ids(EOS)]] * 2
    assert out[P.OUT_PAD_ID].tolist() == [[tok.convert_tokens_to_ids(PAD)]] * 2


def test_stop_and_bad_words_use_trtllm_word_lists(pre: P.Preprocessor):
    tok = pre.tokenizer
    stops = np.array([[b"lazy dog", b"fox"], [b"block", b""]], dtype=object)
    out = pre.preprocess(processing_request(["the fox", "a block"], **{P.STOP_WORDS: stops}))
    assert out[P.STOP_WORDS_IDS].shape[:2] == (2, 2)
    im_end = tok.convert_tokens_to_ids(IM_END)  # generation_config's second eos id becomes a stop word
    first = decode_word_list(out[P.STOP_WORDS_IDS][0])
    assert first == [
        tok.encode("lazy dog", add_special_tokens=False),
        tok.encode("fox", add_special_tokens=False),
        [im_end],
    ]
    assert decode_word_list(out[P.STOP_WORDS_IDS][1]) == [tok.encode("block", add_special_tokens=False), [im_end]]
    assert [decode_word_list(r) for r in out[P.BAD_WORDS_IDS]] == [[], []]
    assert tok.decode(first[0]) == "lazy dog"


def test_bad_words_are_refused_empty_ones_accepted(pre: P.Preprocessor):
    """The EAGLE decoding mode bans no words: a request sending some is refused rather than silently unbanned."""
    empty = np.array([[b""], [b""]], dtype=object)
    out = pre.preprocess(processing_request(["the fox", "a block"], **{P.BAD_WORDS: empty}))
    assert [decode_word_list(r) for r in out[P.BAD_WORDS_IDS]] == [[], []]
    bad = np.array([[b""], [b"fox"]], dtype=object)
    with pytest.raises(ValueError, match="^bad_words refused: it bans words, which TensorRT-LLM's EAGLE decoding mode"):
        pre.preprocess(processing_request(["the fox", "a block"], **{P.BAD_WORDS: bad}))


def test_explicit_end_and_pad_ids_pass_through(pre: P.Preprocessor):
    out = pre.preprocess(
        processing_request(["the dog"], **{P.END_ID: np.array([[7]], np.int32), P.PAD_ID: np.array([[9]], np.int32)})
    )
    assert (out[P.OUT_END_ID].tolist(), out[P.OUT_PAD_ID].tolist()) == ([[7]], [[9]])


def test_sampling_requests_are_refused_greedy_accepted(pre: P.Preprocessor, tokenizer_dir: Path):
    with pytest.raises(ValueError, match="temperature 0.7 refused: this DFlash engine verifies drafts greedily"):
        pre.preprocess(processing_request(["the dog"], **{P.TEMPERATURE: np.array([[0.7]], np.float32)}))
    pre.preprocess(processing_request(["the dog"], **{P.TEMPERATURE: np.array([[0.0]], np.float32)}))
    lossless = P.Preprocessor.from_dir(
        str(tokenizer_dir), add_special_tokens=False, max_input_len=32, max_seq_len=64, max_temperature=float("inf")
    )
    lossless.preprocess(processing_request(["the dog"], **{P.TEMPERATURE: np.array([[0.7]], np.float32)}))


def test_bad_prompts_are_refused(pre: P.Preprocessor):
    with pytest.raises(ValueError, match="empty prompt"):
        pre.preprocess(processing_request([""]))
    with pytest.raises(ValueError, match="the engine accepts at most 32"):
        pre.preprocess(processing_request(["the quick brown fox jumps over the lazy dog " * 8]))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        pre.preprocess(processing_request(["the dog"], **{P.REQUEST_OUTPUT_LEN: np.array([[0]], np.int32)}))


def test_prompt_and_budget_beyond_the_longest_request_are_refused(pre: P.Preprocessor):
    """The longest request is 64 tokens here (prompt + max_tokens): exactly 64 passes, 65 is refused naming the
    room left, and so is a prompt that leaves no room at all."""
    prompt = pre.tokenizer.encode("the quick brown fox", add_special_tokens=False)

    def request(max_tokens: int) -> dict:
        return processing_request(["the quick brown fox"], **{P.REQUEST_OUTPUT_LEN: np.array([[max_tokens]], np.int32)})

    out = pre.preprocess(request(64 - len(prompt)))
    assert out[P.OUT_REQUEST_OUTPUT_LEN].tolist() == [[64 - len(prompt)]]
    message = f"= 65 exceeds the longest request the engine holds \\(64\\); send max_tokens <= {64 - len(prompt)}"
    with pytest.raises(ValueError, match=message):
        pre.preprocess(request(65 - len(prompt)))
    short = P.Preprocessor(pre.tokenizer, add_special_tokens=False, max_input_len=32, max_seq_len=3, max_temperature=0)
    with pytest.raises(ValueError, match=f"prompt has {len(prompt)} tokens; the engine holds requests"):
        short.preprocess(request(1))


def test_postprocess_detokenizes_streamed_chunks(pre: P.Preprocessor, tokenizer_dir: Path):
    post = P.Postprocessor.from_dir(str(tokenizer_dir), skip_special_tokens=True)
    tok = pre.tokenizer
    ids = tok.encode("speculative decoding é", add_special_tokens=False) + [tok.convert_tokens_to_ids(EOS)]
    padded = np.array([[ids + [5, 5]]], dtype=np.int32)  # [batch, beam, L] with junk past the length
    out = post.postprocess({P.TOKENS_BATCH: padded, P.SEQUENCE_LENGTH: np.array([[len(ids)]], np.int32)})
    assert out[P.OUTPUT].shape == (1, 1) and out[P.OUTPUT][0, 0].decode() == "speculative decoding é"
    two_d = post.postprocess({P.TOKENS_BATCH: np.array([ids[:3]], np.int32), P.SEQUENCE_LENGTH: np.array([3])})
    assert two_d[P.OUTPUT][0, 0].decode() == tok.decode(ids[:3])
