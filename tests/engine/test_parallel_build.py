"""Parallel TP engine builds: one `rank_build` process per rank, at most `--workers` at a time.

TensorRT-LLM cannot run here, so `tensorrt_llm.commands.build` is replaced by a stand-in package with the three
functions `rank_build` touches, shaped like the 1.2.x ones (`main()` parses the trtllm-build arguments and calls
`parallel_build`, which builds every rank through `build_and_save`); its `build_and_save` writes a fake engine file
and records which process built which rank when. This proves the orchestration only (processes, GPU ids,
concurrency, failure handling, staging), not that TensorRT-LLM builds the engine. Its `main()` also writes the
engine's config.json the way 1.2.x's builder.build() settles it (restated from builder.py), so a plan that records
anything else is refused before the engine is published.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from _engine_checkpoints import DRAFT_HF, write_checkpoint

from dflash_trt.errors import DFlashTrtError
from dflash_trt.trtllm import build as engine_build
from dflash_trt.trtllm.build_plan import plan_engine_build
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.engine_manifest import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[2]

FAKE_TRTLLM_BUILD = """
import argparse, json, os, sys, time
from pathlib import Path


def build_and_save(rank, gpu_id, ckpt_dir, build_config, output_dir, log_level, model_config, model_cls, **kwargs):
    start = time.time()
    if rank == int(os.environ.get("FAIL_RANK", "-1")):
        raise RuntimeError(f"rank {rank} failed")
    time.sleep(float(os.environ.get("RANK_SECONDS", "0.6")))
    record = {"rank": rank, "gpu": gpu_id, "pid": os.getpid(), "start": start, "end": time.time(),
              "model_cls": model_cls, "plugin": os.environ.get("DFLASH_TRT_PLUGIN_LIB"),
              "draft_tree": os.environ.get("DFLASH_TRT_DRAFT_TREE")}
    Path(output_dir, f"rank{rank}.engine").write_text(json.dumps(record))


def parallel_build(model_config, ckpt_dir, build_config, output_dir, workers=1, log_level="info", model_cls=None,
                   **kwargs):
    for rank in range(model_config["world_size"]):
        build_and_save(rank, rank % workers, ckpt_dir, build_config, output_dir, log_level, model_config, model_cls,
                       **kwargs)


def engine_config(args, checkpoint):
    # config.json as 1.2.x's builder.build() leaves it, restated from builder.py as read: the FP8 / paged context
    # FMHA logic, the NVFP4 GEMM plugin, the EAGLE branch, max_seq_len + max_draft_len + num_eagle_layers (the
    # model's K, the checkpoint's drafts per step: 2K for a chain, N + K for a draft tree of N), opt_num_tokens.
    quant = checkpoint.get("quantization") or {}
    weights, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    fp8_fmha, paged = args.use_fp8_context_fmha == "enable", args.use_paged_context_fmha == "enable"
    if weights not in ("FP8", "W4A8_AWQ", "NVFP4"):
        fp8_fmha = False
        paged = paged and kv != "FP8"
    elif paged:  # SM >= 89
        fp8_fmha = kv == "FP8"
    gemm = None if args.gemm_plugin == "disable" else args.gemm_plugin
    if weights == "NVFP4" and args.gemm_plugin != "disable":
        gemm = "nvfp4"
    paged = True  # "Paged Context FMHA is required for EAGLE. Turning it on"
    plugin = {"dtype": checkpoint["dtype"], "gemm_plugin": gemm, "use_paged_context_fmha": paged,
              "use_fp8_context_fmha": fp8_fmha, "multiple_profiles": args.multiple_profiles == "enable",
              "tokens_per_block": args.tokens_per_block, "paged_kv_cache": True, "remove_input_padding": True,
              "context_fmha": True}
    opt = None if args.multiple_profiles == "enable" else min(args.max_batch_size, args.max_num_tokens)
    eagle_layers = checkpoint["max_draft_len"]
    build = {"max_input_len": args.max_input_len, "max_seq_len": args.max_seq_len + args.max_draft_len + eagle_layers,
             "max_batch_size": args.max_batch_size, "max_beam_width": args.max_beam_width,
             "max_num_tokens": args.max_num_tokens, "opt_num_tokens": opt, "kv_cache_type": "PAGED",
             "strongly_typed": True, "gather_context_logits": False, "max_draft_len": args.max_draft_len,
             "speculative_decoding_mode": 32, "plugin_config": plugin}
    pretrained = {**checkpoint, "quantization": {**quant, "group_size": 128}}
    return {"version": "1.2.1", "pretrained_config": pretrained, "build_config": build}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir")
    parser.add_argument("--output_dir")
    parser.add_argument("--model_cls_name")
    parser.add_argument("--workers", type=int, default=1)
    for flag in ("max_input_len", "max_seq_len", "max_batch_size", "max_beam_width", "max_num_tokens",
                 "max_draft_len", "tokens_per_block"):
        parser.add_argument("--" + flag, type=int)
    for flag in ("gemm_plugin", "use_fp8_context_fmha", "use_paged_context_fmha", "multiple_profiles"):
        parser.add_argument("--" + flag)
    args, _ = parser.parse_known_args()
    os.makedirs(args.output_dir, exist_ok=True)
    checkpoint = json.loads(Path(args.checkpoint_dir, "config.json").read_text())
    Path(args.output_dir, "config.json").write_text(json.dumps(engine_config(args, checkpoint)))
    parallel_build({"world_size": checkpoint["mapping"]["world_size"]}, args.checkpoint_dir, {}, args.output_dir,
                   args.workers, "info", args.model_cls_name, logits_dtype="float32")
"""


@pytest.fixture
def fake_trtllm(tmp_path: Path, monkeypatch) -> Path:
    package = tmp_path / "site" / "tensorrt_llm"
    (package / "commands").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "commands" / "__init__.py").write_text("")
    (package / "commands" / "build.py").write_text(FAKE_TRTLLM_BUILD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    monkeypatch.setattr(engine_build, "check_build_host", lambda plan: "1.2.1")
    return package


def _plan(tmp_path: Path, tp: int, workers: int, draft_tree: int | None = None):
    ckpt = write_checkpoint(tmp_path / "ckpt", mapping={"world_size": tp, "tp_size": tp, "pp_size": 1})
    library = tmp_path / "libdflash_trt_plugins.so"
    settings = replace(EngineBuildSettings(), workers=workers, draft_tree=draft_tree)
    return plan_engine_build(ckpt, tmp_path / "engine", settings, plugin_library=library)


def _records(engine: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in engine.glob("rank*.engine")), key=lambda r: r["rank"])


def test_ranks_build_in_parallel_processes(fake_trtllm: Path, tmp_path: Path):
    plan = _plan(tmp_path, tp=4, workers=2)
    assert plan.parallel_workers == 2 and len(plan.rank_commands()) == 4
    engine = engine_build.run_engine_build(plan)
    records = _records(engine)
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    assert [r["gpu"] for r in records] == [0, 1, 0, 1]  # rank % workers, as trtllm-build's own pool assigns
    assert len({r["pid"] for r in records}) == 4 and os.getpid() not in {r["pid"] for r in records}
    assert {r["model_cls"] for r in records} == {"DFlashForCausalLM"}
    assert {r["plugin"] for r in records} == {str(tmp_path / "libdflash_trt_plugins.so")}
    intervals = [(r["start"], r["end"]) for r in records]
    overlapping = [(a, b) for a in intervals for b in intervals if a < b and a[0] < b[1] and b[0] < a[1]]
    assert overlapping, "no two ranks were built at the same time"
    at_once = max(sum(s <= t < e for s, e in intervals) for t, _ in intervals)
    assert at_once <= 2, "more ranks at once than --workers"
    assert json.loads((engine / MANIFEST_NAME).read_text())["tp_size"] == 4
    assert not list(tmp_path.glob(".engine.partial-*"))


def test_every_rank_builds_the_planned_tree_and_only_it(fake_trtllm: Path, tmp_path: Path, monkeypatch):
    """A tree build hands its node count to every rank's process; a chain build drops one the shell had set."""
    monkeypatch.setenv("RANK_SECONDS", "0")
    monkeypatch.setenv("DFLASH_TRT_DRAFT_TREE", "99")
    tree = engine_build.run_engine_build(_plan(tmp_path / "tree", tp=2, workers=2, draft_tree=40))
    assert [r["draft_tree"] for r in _records(tree)] == ["40", "40"]
    chain = engine_build.run_engine_build(_plan(tmp_path / "chain", tp=2, workers=2))
    assert [r["draft_tree"] for r in _records(chain)] == [None, None]


def test_a_failing_rank_stops_the_build_and_leaves_nothing(fake_trtllm: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("FAIL_RANK", "1")
    monkeypatch.setenv("RANK_SECONDS", "30")  # rank 0 would still be running: it must be stopped, not awaited
    plan = _plan(tmp_path, tp=4, workers=2)
    with pytest.raises(DFlashTrtError, match=r"building rank 1 failed .* the other ranks were stopped"):
        engine_build.run_engine_build(plan)
    assert not (tmp_path / "engine").exists() and not list(tmp_path.glob(".engine.partial-*"))


def test_one_worker_or_one_rank_stays_a_single_trtllm_build(tmp_path: Path):
    serial = _plan(tmp_path / "a", tp=4, workers=1)
    single = _plan(tmp_path / "b", tp=1, workers=8)
    for plan in (serial, single):
        assert plan.parallel_workers == 1 and plan.rank_commands() == []
        assert shlex.split(plan.shell_command()) == ["DFLASH_TRT_DRAFT_LEN_SCHEDULE=none", *plan.command]
        assert plan.command[0] == "trtllm-build"
    assert serial.command[serial.command.index("--workers") + 1] == "1"


def test_parallel_dry_run_prints_a_runnable_shell_line(tmp_path: Path):
    """The printed line runs the same per-rank commands through xargs (executed here with `echo` as python)."""
    plan = _plan(tmp_path, tp=4, workers=2)
    line = plan.shell_command(with_library=True)
    assert line.startswith("seq 0 3 | DFLASH_TRT_PLUGIN_LIB=") and "xargs -P 2 -I{}" in line
    echoed = subprocess.run(
        ["bash", "-c", line.replace("xargs -P 2 -I{} python", "xargs -P 1 -I{} echo")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    expected = [shlex.join(c[1:]) for c in plan.rank_commands()]
    assert sorted(echoed) == sorted(expected)


QUANTIZED = {
    "fp8 + fp8 kv": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
    "fp8": {"quant_algo": "FP8", "kv_cache_quant_algo": None},
    "nvfp4 + fp8 kv": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"},
}


def _quantized_plan(tmp_path: Path, quantization: dict):
    draft = {**DRAFT_HF, "num_attention_heads": 8}  # 4 query heads per KV head: clear of XQA's small-batch layout
    ckpt = write_checkpoint(tmp_path / "ckpt", draft_hf=draft, mapping={"world_size": 2, "tp_size": 2, "pp_size": 1})
    config = json.loads((ckpt / "config.json").read_text())
    for section in (config, config["dflash_config"]):
        section["quantization"] = {**quantization, "group_size": 16}
    (ckpt / "config.json").write_text(json.dumps(config))
    gpu = "b200" if quantization["quant_algo"] == "NVFP4" else "h200"  # NVFP4 GEMMs exist from Blackwell on
    settings = replace(EngineBuildSettings(), workers=2, gemm_plugin="auto", gpu=gpu)
    return plan_engine_build(ckpt, tmp_path / "engine", settings, plugin_library=tmp_path / "lib.so")


@pytest.mark.parametrize("quantization", QUANTIZED.values(), ids=QUANTIZED.keys())
def test_the_built_engine_holds_what_the_plan_recorded(fake_trtllm: Path, tmp_path: Path, quantization: dict):
    """FP8 context FMHA and the NVFP4 GEMM plugin as builder.build() settles them: the plan already says so."""
    plan = _quantized_plan(tmp_path, quantization)
    engine = engine_build.run_engine_build(plan)
    built = json.loads((engine / "config.json").read_text())["build_config"]["plugin_config"]
    assert built["use_fp8_context_fmha"] is (quantization["kv_cache_quant_algo"] == "FP8")
    assert built["gemm_plugin"] == ("nvfp4" if quantization["quant_algo"] == "NVFP4" else "auto")


def test_an_engine_unlike_its_record_is_not_published(fake_trtllm: Path, tmp_path: Path):
    """What the plan recorded before the builder's overrides were mirrored (FP8 context FMHA off with FP8 weights and
    an FP8 cache, the dtype GEMM plugin for NVFP4): the built engine differs, the build fails, nothing is left."""
    plan = _quantized_plan(tmp_path, QUANTIZED["nvfp4 + fp8 kv"])
    plugin = plan.dflash_manifest["engine_config"]["build_config"]["plugin_config"]
    plugin.update(use_fp8_context_fmha=False, gemm_plugin="auto")
    with pytest.raises(DFlashTrtError) as failure:
        engine_build.run_engine_build(plan)
    assert "plugin_config.use_fp8_context_fmha: built True, recorded False" in str(failure.value)
    assert "plugin_config.gemm_plugin: built 'nvfp4', recorded 'auto'" in str(failure.value)
    assert not (tmp_path / "engine").exists() and not list(tmp_path.glob(".engine.partial-*"))
