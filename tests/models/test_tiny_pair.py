"""The embedded tiny pair: its data, tokenizer and files, and that its drafter genuinely predicts its target.

Loads the committed assets only (no training). Oracles: HF transformers (tokenizer, greedy generate),
the reference `dflash` package (`DFlashDraftModel`, `dflash_generate`), and Python integer arithmetic.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from dflash.model import DFlashDraftModel, extract_context_feature
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

from dflash_trt.tiny import corpus, evaluate, models, train
from dflash_trt.tiny.build import Recipe, sha256_file
from dflash_trt.tiny.heldout import (
    asset_dir,
    dflash2_draft_dir,
    draft_dir,
    extract_answer,
    is_correct,
    load_heldout,
    target_dir,
)
from dflash_trt.tiny.tokenizer import build_tokenizer

ACCURACY_PROMPTS = 200
ACCEPTANCE_PROMPTS = 40
MIN_ACCURACY = 0.90
MIN_ACCEPTANCE_B16 = 4.0
MIN_ACCEPTANCE_DFLASH2 = 3.0  # block 8
VERIFIER_MODULES = ("embed_tokens", "lm_head", "verifier_")  # the target's, shared by the DFlash2 drafter


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second thread only adds waiting on a busy machine. Restored for other modules."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((asset_dir() / "manifest.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(target_dir()))


@pytest.fixture(scope="module")
def target() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(str(target_dir()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft() -> DFlashDraftModel:
    return DFlashDraftModel.from_pretrained(str(draft_dir()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout():
    return load_heldout()


@pytest.fixture(scope="module")
def greedy_ids(target, tokenizer, heldout):
    return evaluate.greedy_token_ids(target, tokenizer, heldout[:ACCURACY_PROMPTS])


# --- corpus -------------------------------------------------------------------------------------------


def test_corpus_is_deterministic_per_seed():
    first = corpus.corpus_sha256(list(corpus.generate(7, 500, heldout=False)))
    again = corpus.corpus_sha256(list(corpus.generate(7, 500, heldout=False)))
    other = corpus.corpus_sha256(list(corpus.generate(8, 500, heldout=False)))
    assert first == again
    assert first != other


def test_manifest_corpus_hash_is_reproduced(manifest):
    recipe = Recipe(**manifest["recipe"])
    problems = list(corpus.generate(recipe.seed, recipe.train_problems, heldout=False))
    assert corpus.corpus_sha256(problems) == manifest["corpus_sha256"]


def test_heldout_file_is_the_heldout_split_and_disjoint_from_training(manifest, heldout):
    recipe = Recipe(**manifest["recipe"])
    regenerated = list(corpus.generate(recipe.seed + 1, recipe.heldout_problems, heldout=True))
    assert [(p.prompt, p.answer) for p in regenerated] == [(h.text, h.answer) for h in heldout]
    train_prompts = {p.prompt for p in corpus.generate(recipe.seed, 20_000, heldout=False)}
    assert not train_prompts & {h.text for h in heldout}
    assert {p.task for p in regenerated} == set(corpus.TASKS)


def _oracle_answer(prompt: str) -> str:
    """The answer from Python integers, independent of the corpus's digit-by-digit rendering."""
    task, *operands = prompt.split()
    values = [int(v) for v in operands]
    if task == "add":
        return str(values[0] + values[1])
    if task == "sub":
        return str(abs(values[0] - values[1]))
    if task == "mul":
        return str(values[0] * values[1])
    return f"{values[0] + corpus.COUNT_STEPS:0{corpus.WIDTH}d}"


def _check_step_line(task: str, line: str) -> None:
    if task == "add":
        a, b, c, s = map(int, re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d\d)", line).groups())
        assert a + b + c == s
    elif task == "mul":
        a, m, c, s = map(int, re.fullmatch(r"(\d)\*(\d)\+(\d)=(\d\d)", line).groups())
        assert a * m + c == s
    elif task == "sub":
        a, b, c, d, out = map(int, re.fullmatch(r"(\d)-(\d)-(\d)=(\d) b(\d)", line).groups())
        assert a - b - c == d - 10 * out


def test_worked_steps_and_answers_are_arithmetically_right():
    for problem in corpus.generate(3, 400, heldout=False):
        assert problem.answer == _oracle_answer(problem.prompt)
        assert extract_answer(problem.response) == problem.answer
        for line in problem.response.splitlines()[:-1]:
            _check_step_line(problem.task, line)


def test_answer_check_rejects_wrong_or_missing_answers():
    assert is_correct("1+2+0=03\nans 3\n", "3")
    assert not is_correct("1+2+0=03\nans 4\n", "3")
    assert not is_correct("1+2+0=03\nans 31\n", "3")
    assert not is_correct("1+2+0=03\n", "3")


# --- tokenizer and files ------------------------------------------------------------------------------


def test_tokenizer_round_trips_with_special_tokens(tokenizer, heldout, draft):
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|mask|>") == draft.mask_token_id
    assert draft.mask_token_id != tokenizer.eos_token_id
    texts = [h.text for h in heldout] + [p.text for p in corpus.generate(5, 40, heldout=False)]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tokenizer.decode(ids) == text
    with_eos = tokenizer("ans 12\n", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == "ans 12\n"
    assert tokenizer.vocab_size == len(build_tokenizer()) <= models.VOCAB_SIZE


def test_target_is_a_plain_hf_qwen3_checkpoint(target, tokenizer):
    config = json.loads((target_dir() / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert AutoConfig.from_pretrained(str(target_dir())).model_type == "qwen3"
    assert 1_000_000 <= sum(p.numel() for p in target.parameters()) <= 5_000_000


def test_draft_is_in_zlab_format(draft, target):
    config = json.loads((draft_dir() / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 16 and config["num_target_layers"] == target.config.num_hidden_layers
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    with safe_open(str(draft_dir() / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(n in {"fc.weight", "hidden_norm.weight", "norm.weight"} or n.startswith("layers.") for n in names)
    assert names == set(draft.state_dict())  # nothing missing, no embeddings / lm_head
    assert draft.fc.weight.shape == (target.config.hidden_size, 2 * target.config.hidden_size)


def test_dflash2_drafter_is_in_speculators_format_on_the_same_taps(target, manifest):
    """Written by speculators' own save_pretrained (its config class source left out), loaded back by speculators."""
    from speculators.model import SpeculatorModel

    config = json.loads((dflash2_draft_dir() / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    v1_taps = json.loads((draft_dir() / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert config["aux_hidden_state_layer_ids"] == [t + 1 for t in v1_taps]  # hidden_states indices
    assert sorted(p.name for p in dflash2_draft_dir().iterdir()) == ["config.json", "model.safetensors"]
    model = SpeculatorModel.from_pretrained(str(dflash2_draft_dir()))
    assert model.block_size == manifest["metrics"]["dflash2_block_size"] == 8
    trainable = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(VERIFIER_MODULES))
    assert trainable == manifest["parameters"]["dflash2"]


def test_dflash2_drafter_is_lossless_and_accepts_long_chains(heldout):
    """Its held-out acceptance through the golden model, as the manifest records it (same prompts and budget)."""
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "ckpt"
        convert_checkpoint(target_dir(), dflash2_draft_dir(), checkpoint, dtype="float32")
        model, tokenizer = load_golden_model(checkpoint), load_tokenizer(checkpoint)
        prompts = [tokenizer.encode(p.text) for p in _acceptance_prompts(heldout)]
        stops = list(model.target.spec.eos_token_ids)
        drafted = speculative_generate(model, prompts, evaluate.MAX_NEW_TOKENS, stops)
        alone = speculative_generate(model, prompts, evaluate.MAX_NEW_TOKENS, stops, block_size=1)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in alone]
    means = [sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in drafted]
    assert sum(means) / len(means) >= MIN_ACCEPTANCE_DFLASH2


def test_manifest_hashes_match_the_committed_files(manifest):
    files = sorted(p for p in asset_dir().rglob("*") if p.is_file() and p.name != "manifest.json")
    assert {str(p.relative_to(asset_dir())) for p in files} == set(manifest["files_sha256"])
    for path in files:
        assert sha256_file(path) == manifest["files_sha256"][str(path.relative_to(asset_dir()))], path
    assert sum(p.stat().st_size for p in files) <= 20 * 1024 * 1024


# --- behaviour ----------------------------------------------------------------------------------------


def test_target_greedy_answers_heldout_prompts(tokenizer, heldout, greedy_ids):
    prompts = heldout[:ACCURACY_PROMPTS]
    correct = [
        is_correct(tokenizer.decode(ids, skip_special_tokens=True), p.answer)
        for ids, p in zip(greedy_ids, prompts, strict=True)
    ]
    assert len(prompts) >= 30
    assert sum(correct) / len(correct) >= MIN_ACCURACY


def _acceptance_prompts(heldout):
    """An equal share of every task, so the figure is not one task's."""
    per_task = ACCEPTANCE_PROMPTS // len(corpus.TASKS)
    chosen = []
    for task in corpus.TASKS:
        chosen += [h for h in heldout if h.text.startswith(task + " ")][:per_task]
    return chosen


def test_dflash_generate_is_lossless_and_accepts_long_blocks(draft, target, tokenizer, heldout, greedy_ids):
    prompts = _acceptance_prompts(heldout)
    runs = evaluate.speculative_runs(draft, target, tokenizer, prompts)
    reference = {h.text: ids for h, ids in zip(heldout[:ACCURACY_PROMPTS], greedy_ids, strict=True)}
    for prompt, run in zip(prompts, runs, strict=True):
        assert run.new_token_ids == reference[prompt.text], prompt.text
        assert max(run.acceptance_lengths) <= draft.block_size
    assert evaluate.per_prompt_mean_acceptance_length(runs) >= MIN_ACCEPTANCE_B16


def test_shifted_taps_collapse_acceptance(draft, target, tokenizer, heldout):
    """A drafter fed the wrong target layers must lose most of its acceptance (the metric catches breakage)."""
    prompts = _acceptance_prompts(heldout)[::2]
    good = evaluate.per_prompt_mean_acceptance_length(evaluate.speculative_runs(draft, target, tokenizer, prompts))
    shifted = DFlashDraftModel.from_pretrained(str(draft_dir()), dtype=torch.float32).eval()
    shifted.target_layer_ids = [i + 1 for i in draft.target_layer_ids]
    broken_runs = evaluate.speculative_runs(shifted, target, tokenizer, prompts)
    broken = evaluate.per_prompt_mean_acceptance_length(broken_runs)
    assert broken < 0.6 * good
    assert broken >= 1.0  # still lossless decoding, just slower: every step yields the bonus token


# --- training formulation -----------------------------------------------------------------------------


def test_masked_training_forward_equals_per_anchor_inference_forward():
    """All anchors in one masked forward give the same logits as the reference drafter run per block."""
    torch.manual_seed(0)
    tok = build_tokenizer()
    target_cfg = models.target_config(tok.eos_token_id, tok.pad_token_id)
    target_cfg.intermediate_size = 64  # random weights: only the shapes that matter to the mask are kept
    tgt = Qwen3ForCausalLM(target_cfg).eval()
    drf = DFlashDraftModel(models.draft_config(target_cfg, tok.mask_token_id)).eval()
    data = train.encode(list(corpus.generate(1, 3, heldout=False)), tok)
    anchors = train.sample_anchors(
        data.prompt_lengths, data.lengths, data.ids.shape[1], 5, torch.Generator().manual_seed(0)
    )
    batch = train.draft_batch(
        data.ids, anchors, data.lengths, block_size=drf.block_size, mask_token_id=drf.mask_token_id, gamma=7.0
    )
    with torch.no_grad():
        logits = train.draft_logits(drf, tgt, data.ids, batch).view(3, 5, drf.block_size, -1)
        hidden = tgt.model(input_ids=data.ids, output_hidden_states=True).hidden_states
        context = extract_context_feature(hidden, drf.target_layer_ids)
        for row in range(3):
            for j, anchor in enumerate(anchors[row].tolist()):
                assert data.prompt_lengths[row] <= anchor <= data.lengths[row] - 2
                block = torch.full((1, drf.block_size), drf.mask_token_id)
                block[0, 0] = data.ids[row, anchor]
                out = drf(
                    position_ids=torch.arange(anchor + drf.block_size)[None],
                    noise_embedding=tgt.get_input_embeddings()(block),
                    target_hidden=context[row : row + 1, :anchor],
                )
                torch.testing.assert_close(
                    drf.compute_logits(out, tgt.lm_head)[0], logits[row, j], rtol=1e-4, atol=1e-5
                )


def test_block_labels_and_decay_weights():
    ids = torch.arange(20)[None]
    batch = train.draft_batch(ids, torch.tensor([[10]]), torch.tensor([14]), block_size=8, mask_token_id=99, gamma=2.0)
    assert batch.block_ids.tolist() == [[10] + [99] * 7]
    assert batch.labels[0, :4].tolist() == [10, 11, 12, 13]
    expected = [0.0, 1.0, torch.exp(torch.tensor(-0.5)).item(), torch.exp(torch.tensor(-1.0)).item()] + [0.0] * 4
    torch.testing.assert_close(batch.weights[0], torch.tensor(expected))
    assert batch.position_ids[0, 20:].tolist() == list(range(10, 18))
    visible = batch.attention_mask[0, 0]
    assert visible[:, :10].all() and not visible[:, 10:20].any() and visible[:, 20:].all()
