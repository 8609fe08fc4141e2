"""Greedy speculative decoding is lossless: identical to the target alone (HF generate), batched or not."""

from __future__ import annotations

import json

import pytest
import torch
from _pairs import PairVariant, make_pair
from transformers import AutoModelForCausalLM

from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model

RAGGED = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26], [27, 28]]


@pytest.fixture(scope="module", params=["qwen3", "llama-sliding"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    variant = (
        PairVariant()
        if request.param == "qwen3"
        else PairVariant(
            arch="llama",
            tie=True,
            draft_layers=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    target_dir, draft_dir = make_pair(root, variant)
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float32")
    return root / "ckpt", AutoModelForCausalLM.from_pretrained(target_dir).eval()


def _hf_greedy(model, prompt, max_new):
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_batch_one_equals_target_alone(setup):
    ckpt, hf = setup
    model = load_golden_model(ckpt)
    (result,) = speculative_generate(model, [RAGGED[0]], 40)
    assert result.output_ids == _hf_greedy(hf, RAGGED[0], 40)
    assert sum(result.acceptance_lengths) == 39  # the first token comes from the prefill


def test_ragged_batch_equals_target_alone_and_one_by_one(setup):
    ckpt, hf = setup
    model = load_golden_model(ckpt)
    max_new = [30, 17, 1, 25, 9]
    batched = speculative_generate(model, RAGGED, max_new)
    for prompt, n, result in zip(RAGGED, max_new, batched, strict=True):
        assert result.output_ids == _hf_greedy(hf, prompt, n)
        (alone,) = speculative_generate(model, [prompt], n)
        assert (alone.output_ids, alone.acceptance_lengths) == (result.output_ids, result.acceptance_lengths)
        assert [s.draft_ids for s in alone.steps] == [s.draft_ids for s in result.steps]


def test_stop_tokens_end_each_sequence_independently(setup):
    ckpt, hf = setup
    model = load_golden_model(ckpt)
    free = speculative_generate(model, RAGGED, 24)
    stop = free[0].output_ids[5]
    stopped = speculative_generate(model, RAGGED, 24, [stop])
    for full, cut in zip(free, stopped, strict=True):
        expected = full.output_ids[: full.output_ids.index(stop) + 1] if stop in full.output_ids else full.output_ids
        assert cut.output_ids == expected


def test_generate_cli_json(setup, tmp_path, capsys):
    ckpt, hf = setup
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": p}) for p in RAGGED[:3]) + "\n")
    assert (
        main(
            [
                "generate",
                "--checkpoint_dir",
                str(ckpt),
                "--input_file",
                str(prompts),
                "--max_new_tokens",
                "12",
                "--ignore_eos",
                "--trace",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert [s["input_ids"] for s in report["sequences"]] == RAGGED[:3]
    for record, prompt in zip(report["sequences"], RAGGED[:3], strict=True):
        assert record["output_ids"] == _hf_greedy(hf, prompt, 12)
        assert len(record["steps"]) == len(record["acceptance_lengths"])
        assert all(step["accepted"] <= len(step["draft_ids"]) for step in record["steps"])
    lengths = [n for s in report["sequences"] for n in s["acceptance_lengths"]]
    assert report["mean_acceptance_length"] == pytest.approx(sum(lengths) / len(lengths))


def test_generate_cli_refuses_bad_input(setup, tmp_path, capsys):
    ckpt, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"text": "hello"}\n')
    assert main(["generate", "--checkpoint_dir", str(ckpt), "--input_file", str(bad)]) == 2
    assert "bad.jsonl:2 gives text but no tokenizer was found" in capsys.readouterr().err
    bad.write_text('{"input_ids": [1, 9999]}\n')
    assert main(["generate", "--checkpoint_dir", str(ckpt), "--input_file", str(bad)]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_generate_cli_refuses_a_corrupt_checkpoint_config(setup, tmp_path, edited_copy, capsys):
    ckpt, _ = setup
    broken = edited_copy(ckpt, name="broken")
    (broken / "config.json").write_text('{"architecture": "DFlashForCausalLM",')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    assert main(["generate", "--checkpoint_dir", str(broken), "--input_file", str(prompts)]) == 2
    assert "config.json is not valid JSON" in capsys.readouterr().err


def test_generate_cli_refuses_absurd_checkpoint_dimensions(setup, tmp_path, edited_copy, capsys):
    ckpt, _ = setup
    broken = edited_copy(ckpt, lambda config: config.update(num_hidden_layers=10**9), name="broken")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2]}\n')
    assert main(["generate", "--checkpoint_dir", str(broken), "--input_file", str(prompts)]) == 2
    assert "'num_hidden_layers' must be an integer >= 1 and <= 1024" in capsys.readouterr().err
