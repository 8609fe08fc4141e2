"""`dflash-trt demo` end to end on the embedded pair, and the acceptance metric catching broken conversions."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import dflash.model as reference
import pytest
import torch
from google.protobuf import text_format
from transformers import AutoModelForCausalLM
from tritonclient.grpc import model_config_pb2

from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.stats import mean_acceptance_length
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer


def test_demo_runs_the_whole_cpu_job(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--output_dir", str(out), "--num_prompts", "6", "--max_new_tokens", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["lossless"] and report["accuracy"] >= 0.9
    assert report["mean_acceptance_length"] >= 4.0
    low, high = report["speedup_range"]  # the median of three alternating timed runs, with their spread
    assert low <= report["speedup"] <= high and "3 alternating timed runs" in report["speedup_compares"]
    assert len(report["per_position_acceptance"]) == report["block_size"] - 1
    dflash2 = report["dflash2"]  # the DFlash2 drafter (speculators format) beside it, same prompts and baseline
    assert dflash2["lossless"] and dflash2["accuracy"] >= 0.9 and dflash2["block_size"] == 8
    assert dflash2["mean_acceptance_length"] >= 3.0 and len(dflash2["per_position_acceptance"]) == 7
    assert (out / "checkpoint-dflash2-bfloat16" / "config.json").is_file()
    for qformat in ("fp8", "nvfp4"):
        row = report["quantized"][qformat]
        assert row["lossless_vs_quantized_target"] and row["mean_acceptance_length"] >= 4.0
    assert report["build_command"].startswith("DFLASH_TRT_DRAFT_LEN_SCHEDULE=none trtllm-build --checkpoint_dir")
    sweep = report["sweep"]  # the load generator's sweep on the same pair: DFlash vs the target alone
    assert {(p["engine"], p["concurrency"]) for p in sweep["points"]} == {
        (e, c) for e in ("dflash", "ar") for c in (1, 2, 4)
    }
    assert sweep["dflash_vs_ar_c1"] > 1.0
    assert (out / "sweep" / "pareto.png").is_file() and (out / "sweep" / "results.json").is_file()
    config = (out / "triton_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
    parsed = text_format.Parse(config, model_config_pb2.ModelConfig())
    assert parsed.backend == "tensorrtllm" and parsed.parameters["decoding_mode"].string_value == "eagle"
    assert main(["demo", "--output_dir", str(out), "--num_prompts", "1"]) == 2  # never overwrites unasked
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    _run_gpu_host_commands(report["gpu_host_commands"], out, tmp_path, capsys)


def _run_gpu_host_commands(commands: list[str], out, tmp_path, capsys) -> None:
    """Step 7's lines as printed, in the form this CPU host can run: the build as its `--dry_run`, the bench
    against the checkpoint the engine would be built from, the launch script parsed, the client's usage."""
    cmake, build, launch, bench, client = commands
    assert cmake.startswith("cmake -S plugins")
    assert main([*shlex.split(build)[1:], "--dry_run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    checkpoint = out / "checkpoint-bfloat16"
    config = json.loads((checkpoint / "config.json").read_text())
    # The engine uses 3K positions past its max_seq_len (engine_lengths.longest_max_seq_len).
    k = config["max_draft_len"]
    assert plan["build_config"]["max_seq_len"] == config["max_position_embeddings"] - 3 * k  # derived, written out
    argv = shlex.split(bench)[1:]
    engine = argv.index("--engine_dir")
    argv[engine : engine + 2] = ["--checkpoint_dir", str(checkpoint)]
    prompts = Path(argv[argv.index("--input_file") + 1])
    assert prompts.is_file()  # the demo writes the prompt file it names
    argv[argv.index("--output_dir") + 1] = str(tmp_path / "bench")
    assert main([*argv, "--num_requests", "2", "--max_new_tokens", "8"]) == 0
    assert json.loads((tmp_path / "bench" / "results.json").read_text())["workload"]["path"] == str(prompts.resolve())
    assert subprocess.run(["bash", "-n", *shlex.split(launch)], check=False).returncode == 0
    script = shlex.split(client)
    assert subprocess.run([sys.executable, script[1], "--help"], capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    convert_checkpoint(target_dir(), draft_dir(), root / "ckpt", dtype="float32")
    tokenizer = load_tokenizer(root / "ckpt")
    prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=8)]
    return root / "ckpt", prompts


def _acceptance(checkpoint, prompts) -> float:
    model = load_golden_model(checkpoint)
    return mean_acceptance_length(speculative_generate(model, prompts, 48, list(model.target.spec.eos_token_ids)))


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d.update(target_layer_ids=[t + 1 for t in d["target_layer_ids"]]),  # taps shifted by one layer
        lambda d: d.update(rotary_base=d["rotary_base"] * 4),  # drafter RoPE off
        lambda d: d.update(mask_token_id=d["mask_token_id"] - 1),  # wrong mask token
    ],
    ids=["taps-shifted", "rope-base", "mask-id"],
)
def test_a_silently_broken_conversion_collapses_acceptance(tiny_checkpoint, edited_copy, breakage):
    checkpoint, prompts = tiny_checkpoint
    good = _acceptance(checkpoint, prompts)
    broken = edited_copy(checkpoint, lambda config: breakage(config["dflash_config"]), name="broken")
    assert good >= 4.0
    assert _acceptance(broken, prompts) < 0.6 * good


def test_golden_model_matches_dflash_generate_on_the_trained_pair(tiny_checkpoint, monkeypatch):
    """Real acceptance (not ~1 as on random fixtures): same tokens and same acceptance lengths as the reference."""
    checkpoint, prompts = tiny_checkpoint
    model = load_golden_model(checkpoint)
    stops = list(model.target.spec.eos_token_ids)
    ours = speculative_generate(model, prompts[:4], 48, stops)
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    target = AutoModelForCausalLM.from_pretrained(target_dir(), dtype=torch.float32).eval()
    drafter = reference.DFlashDraftModel.from_pretrained(draft_dir(), dtype=torch.float32).eval()
    for prompt, result in zip(prompts[:4], ours, strict=True):
        stats = reference.dflash_generate(drafter, target, torch.tensor([prompt]), 48, stops, return_stats=True)
        assert result.output_ids == stats.output_ids[0, len(prompt) :].tolist()
        assert result.acceptance_lengths == stats.acceptance_lengths
    assert mean_acceptance_length(ours) >= 4.0


def test_generate_cli_takes_text_prompts_with_the_checkpoint_tokenizer(tiny_checkpoint, tmp_path, capsys):
    checkpoint, _ = tiny_checkpoint
    heldout = load_heldout(limit=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": p.text}) + "\n" for p in heldout))
    assert (
        main(
            [
                "generate",
                "--checkpoint_dir",
                str(checkpoint),
                "--input_file",
                str(prompts),
                "--max_new_tokens",
                "64",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    for record, prompt in zip(report["sequences"], heldout, strict=True):
        assert f"ans {prompt.answer}" in record["output_text"]
    assert report["mean_acceptance_length"] >= 4.0
