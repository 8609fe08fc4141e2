"""The server's incremental detokenizer (`server/detokenizer.py`) against the tokenizer's own `decode` of the whole
output, for every way the output may arrive in engine responses: a real byte-level BPE tokenizer (trained here)
whose multi-byte characters span several tokens, and stop strings and stop ids that must never be sent."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_trt.server.detokenizer import TextStream

CORPUS = ["the quick brown fox — déjà vu, naïve café", "数据 流 解码 🙂 speculative décodage"] * 20
EOS = "<|end|>"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def stream(tokenizer, prompt, chunks, stop=(), stop_ids=frozenset()):
    text = TextStream(tokenizer, prompt, list(stop), frozenset(stop_ids))
    sent = []
    for chunk in chunks:
        sent.append(text.add(chunk))
        if text.finish_reason is not None:
            return "".join(sent), text
    sent.append(text.finish())
    return "".join(sent), text


TEXTS = st.sampled_from(["déjà vu 🙂 数据 流", " naïve café — the fox", "解码 speculative 🙂🙂 décodage"])


@given(TEXTS, st.lists(st.integers(0, 40), max_size=8))
def test_pieces_join_to_the_decoded_output_however_it_arrives(tokenizer, text, cuts):
    prompt = tokenizer.encode("the quick ")
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)  # characters spanning tokens
    got, state = stream(tokenizer, prompt, split(ids, cuts))
    assert got == tokenizer.decode(ids) and state.completion_tokens == len(ids) and state.finish_reason is None


@given(TEXTS, st.lists(st.integers(0, 40), max_size=8), st.integers(1, 6), st.integers(1, 3))
def test_stop_strings_are_cut_and_never_sent(tokenizer, text, cuts, start, length):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    stop = full[start : start + length]
    got, state = stream(tokenizer, [], split(ids, cuts), stop=[stop, "never there"])
    assert got == full[: full.index(stop)] and state.finish_reason == "stop"


def test_a_stop_id_ends_the_output_and_counts_as_produced(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("déjà vu")
    got, state = stream(tokenizer, [], [ids[:2], [*ids[2:], eos, *ids]], stop_ids={eos})
    assert got == tokenizer.decode(ids) and state.completion_tokens == len(ids) + 1 and state.finish_reason == "stop"


@given(TEXTS, st.lists(st.integers(0, 40), max_size=8), st.integers(1, 6), st.integers(1, 3))
def test_a_stop_string_ends_the_output_at_the_token_that_completes_it(tokenizer, text, cuts, start, length):
    """Whatever else the response holds (here the stop id right after the output, often in the same response),
    the text ends before the stop string and the count runs to the token that completed it."""
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    stop = full[start : start + length]
    last = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))
    eos = tokenizer.eos_token_id
    got, state = stream(tokenizer, [], split([*ids, eos], cuts), stop=[stop], stop_ids={eos})
    assert got == full[: full.index(stop)] and state.finish_reason == "stop"
    assert state.completion_tokens == last + 1
