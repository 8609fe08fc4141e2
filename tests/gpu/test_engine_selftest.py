"""End-to-end engine self-test on a TensorRT-LLM 1.2.x GPU host: the engine must decode exactly like the golden model.

Builds the plugin library (unless DFLASH_TRT_PLUGIN_LIB points at one), converts a tiny random Qwen3 target + DFlash
drafter pair, builds the DFlash engine through `dflash-trt build`'s code path, runs it through the executor in EAGLE
mode (chain eagle_choices from dflash_trt.json; `dflash_trt.commands.selftest.engine_generate`, one response per
iteration) on ragged prompts and compares every token and the per-step acceptance lengths both define the same way
with `dflash_trt.reference.decode.speculative_generate` on the same checkpoint. Greedy only. The engine is built
for this host's GPU, so it runs the attention route that GPU needs (DFlashAttention for both generation passes on
B200 / B300); a second pair's drafter has a sliding-window layer (DFlashAttention on every GPU) and its prompts
decode past the window. `dflash-trt selftest` runs the same check on the embedded trained tiny pair.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.trtllm]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
MAX_NEW = 24
END_ID = 1  # the tiny pair's eos; both sides stop on it


def tiny_pairs():
    """tests/_pairs.py (the fixture-pair writer shared with the CPU parity tests)."""
    spec = importlib.util.spec_from_file_location("_pairs", ROOT / "tests" / "_pairs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plugin_library(workdir: Path) -> Path:
    from dflash_trt.trtllm.plugin import LIBRARY_ENV, LIBRARY_NAME

    if os.environ.get(LIBRARY_ENV):
        return Path(os.environ[LIBRARY_ENV])
    if shutil.which("cmake") is None:
        pytest.skip(f"cmake not found and {LIBRARY_ENV} not set: cannot build the plugin library")
    build = workdir / "plugins-build"
    subprocess.run(["cmake", "-S", str(ROOT / "plugins"), "-B", str(build)], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", "--target", "dflash_trt_plugins"], check=True)
    return next(build.rglob(LIBRARY_NAME))


def built_engine(root: Path, variant, draft_len_schedule: str = "none"):
    """A random pair of `variant` (tests/_pairs.py), converted in float16, built as `dflash-trt build` builds."""
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.gpu_targets import resolve_gpu
    from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
    from dflash_trt.trtllm.build import run_engine_build
    from dflash_trt.trtllm.build_plan import plan_engine_build
    from dflash_trt.trtllm.build_settings import EngineBuildSettings

    library = plugin_library(root)
    target_dir, draft_dir = tiny_pairs().make_pair(root, variant)
    convert_checkpoint(target_dir, draft_dir, root / "ckpt", dtype="float16")
    gpu, _ = resolve_gpu(None)
    settings = EngineBuildSettings(
        max_batch_size=4,
        max_input_len=64,
        max_seq_len=128,
        max_num_tokens=256,
        draft_len_schedule=DRAFT_LEN_SCHEDULE(draft_len_schedule),
        gpu=gpu,
    )
    plan = plan_engine_build(root / "ckpt", root / "engine", settings, plugin_library=library)
    return run_engine_build(plan), root / "ckpt", library


# Production head size (the kernels are specialised per head size): 128, as Qwen3 and Llama 3.x; DFlashAttention
# takes it too (the fixture default, 16, is only for the stock plugin's Hopper route).
HEAD_DIMS = {"head_dim": 128, "draft_head_dim": 128}
PAIRS = {
    "full": {"block_size": 8, **HEAD_DIMS},
    "sliding": {
        "block_size": 8,
        **HEAD_DIMS,
        "sliding_window": 6,
        "layer_types": ["full_attention", "sliding_attention"],
    },
}


@pytest.fixture(scope="module", params=list(PAIRS))
def engine(request, tmp_path_factory):
    variant = tiny_pairs().PairVariant(**PAIRS[request.param])
    return built_engine(tmp_path_factory.mktemp(f"selftest-{request.param}"), variant)


@pytest.fixture(scope="module")
def dflash2_engine(tmp_path_factory):
    """A DFlash2 drafter (convolutions, in-graph top-k and selector walk) with an embedding tap."""
    dflash2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 12, "selector_top_k": 6}
    variant = tiny_pairs().PairVariant(block_size=8, dflash2=dflash2, taps=[-1, 3], **HEAD_DIMS)
    return built_engine(tmp_path_factory.mktemp("selftest-dflash2"), variant)


@pytest.fixture(scope="module")
def scheduled_engine(tmp_path_factory):
    """Drafts 3 of 7 with two requests in a step, 1 with three or more (docs/engine.md §4.1)."""
    variant = tiny_pairs().PairVariant(block_size=8)
    return built_engine(tmp_path_factory.mktemp("selftest-scheduled"), variant, "2:3,3:1")


def test_an_engine_drafting_by_load_decodes_the_targets_tokens(scheduled_engine):
    """The runtime feeds the network's per-request `next_draft_lens` back as variable generation lengths; greedy
    tokens stay the target's (compared tie-aware: float16), all four prompts in flight (drafts of 1) and one alone
    (the full 7). Acceptance lengths are not compared: the random pair accepts little at any draft length."""
    from dflash_trt.commands.selftest import engine_generate
    from dflash_trt.reference.decode import SequenceResult, speculative_generate
    from dflash_trt.reference.divergence import compare_decodings
    from dflash_trt.reference.model import load_golden_model

    engine_dir, checkpoint, library = scheduled_engine
    config = json.loads((engine_dir / "config.json").read_text())
    manifest = json.loads((engine_dir / "dflash_trt.json").read_text())
    assert config["pretrained_config"]["draft_len_schedule"] == manifest["draft_len_schedule"] == "2:3,3:1"
    model = load_golden_model(checkpoint)
    for prompts in (PROMPTS, PROMPTS[:1]):
        alone = speculative_generate(model, prompts, MAX_NEW, [END_ID], block_size=1)
        tokens, acceptance = engine_generate(engine_dir, str(library), prompts, MAX_NEW, END_ID)
        assert all(1 <= n <= 8 for steps in acceptance for n in steps)
        engine = [SequenceResult(g.input_ids, t, g.acceptance_lengths) for g, t in zip(alone, tokens, strict=True)]
        assert [str(d) for d in compare_decodings(model, alone, engine, MAX_NEW) if not d.near_tie] == []


@pytest.mark.parametrize("which", ["engine", "dflash2_engine"])
def test_engine_matches_golden_model(which, request):
    from dflash_trt.commands.selftest import compare, engine_generate
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model

    engine_dir, checkpoint, library = request.getfixturevalue(which)
    model = load_golden_model(checkpoint)
    golden = speculative_generate(model, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[END_ID])
    tokens, acceptance = engine_generate(engine_dir, str(library), PROMPTS, MAX_NEW, END_ID)
    divergences = compare(model, golden, tokens, acceptance, MAX_NEW)
    assert [str(d) for d in divergences if not d.near_tie] == []


def test_engine_config_carries_the_eagle_contract(engine):
    engine_dir, _, _ = engine
    config = json.loads((engine_dir / "config.json").read_text())
    manifest = json.loads((engine_dir / "dflash_trt.json").read_text())
    pretrained, build = config["pretrained_config"], config["build_config"]
    k = manifest["max_draft_len"]
    assert pretrained["architecture"] == "DFlashForCausalLM"
    assert pretrained["num_eagle_layers"] == k and pretrained["max_non_leaves_per_layer"] == 1
    assert pretrained["eagle_net_config"]["num_hidden_layers"] == manifest["num_draft_layers"]
    assert "layer_types" not in pretrained
    assert build["max_draft_len"] == k and build["speculative_decoding_mode"] == 1 << 5
    from dflash_trt.gpu_targets import resolve_gpu

    assert manifest["gpu"] == resolve_gpu(None)[0]  # built for this host's GPU and its attention route
    from dflash_trt.trtllm.engine_manifest import check_engine_config

    check_engine_config(engine_dir)  # what the plan recorded (build() overrides mirrored) is what was built


def test_an_fp8_engine_with_an_fp8_kv_cache_matches_the_golden_model(tmp_path):
    """FP8 weights with an FP8 KV cache: 1.2.x runs context attention as FP8 context FMHA (the builder turns it on),
    and the golden model computes it that way too (`reference.quantized.fp8_context_attention`); first divergences
    within FP8's resolution are near-ties."""
    pytest.importorskip("modelopt.torch.quantization")
    from dflash_trt.commands.selftest import compare, engine_generate
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.trtllm.build import run_engine_build
    from dflash_trt.trtllm.build_plan import plan_engine_build
    from dflash_trt.trtllm.build_settings import EngineBuildSettings

    library = plugin_library(tmp_path)
    pairs = tiny_pairs()
    # 8 query heads per KV head x 8-token blocks = 64 rows: outside Hopper XQA's causal small-batch layout (the plan
    # refuses an FP8-KV drafter inside it).
    variant = pairs.PairVariant(
        block_size=8, kv_heads=1, draft_heads=8, draft_kv_heads=1, head_dim=128, draft_head_dim=128, intermediate=128
    )
    target_dir, draft_dir = pairs.make_pair(tmp_path, variant)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    convert_checkpoint(target_dir, draft_dir, tmp_path / "ckpt", dtype="bfloat16", qformat="fp8",
                       kv_cache_dtype="fp8", calib_dataset=calib, calib_size=len(PROMPTS))  # fmt: skip
    from dflash_trt.gpu_targets import resolve_gpu

    settings = EngineBuildSettings(
        max_batch_size=4, max_input_len=64, max_seq_len=128, max_num_tokens=256, gpu=resolve_gpu(None)[0]
    )
    plan = plan_engine_build(tmp_path / "ckpt", tmp_path / "engine", settings, plugin_library=library)
    assert plan.dflash_manifest["engine_config"]["build_config"]["plugin_config"]["use_fp8_context_fmha"]
    engine_dir = run_engine_build(plan)
    model = load_golden_model(tmp_path / "ckpt")
    golden = speculative_generate(model, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[END_ID])
    tokens, acceptance = engine_generate(engine_dir, str(library), PROMPTS, MAX_NEW, END_ID)
    divergences = compare(model, golden, tokens, acceptance, MAX_NEW)
    assert [str(d) for d in divergences if not d.near_tie] == []


def test_bench_drives_the_engine_in_flight(engine, tmp_path):
    """`dflash-trt bench --engine_dir`: every request completes with the golden model's tokens at 1 and 3 users."""
    from dflash_trt.bench.results import load_results
    from dflash_trt.cli import main
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model

    engine_dir, checkpoint, library = engine
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "bench"
    assert (
        main(
            [
                "bench",
                "--engine_dir",
                str(engine_dir),
                "--plugin_library",
                str(library),
                "--input_file",
                str(prompts),
                "--max_new_tokens",
                str(MAX_NEW),
                "--end_id",
                str(END_ID),
                "--concurrency",
                "1,3",
                "--output_dir",
                str(out),
            ]
        )
        == 0
    )
    golden = speculative_generate(
        load_golden_model(checkpoint), PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[END_ID]
    )
    for point in load_results(out / "results.json"):
        assert point["failed"] == 0 and point["max_in_flight"] == point["concurrency"]
        for request in point["per_request"]:
            assert request["output_ids"] == golden[request["prompt_index"]].output_ids


@pytest.mark.parametrize("temperature", [1e-40, 1e-45])
def test_temperatures_too_small_to_invert_decode_greedily_in_the_engine(engine, temperature):
    """The executor hands the engine the raw temperature (the Python edge's mapping to 0 bypassed, as a client of the
    C++ executor or of Triton's tensorrtllm backend sends it): the in-graph rule (trtllm/verify.py) must take the
    argmax, where 1/T would be inf in float32, and decode exactly as at temperature 0."""
    import asyncio

    from dflash_trt.bench.driver import run_load
    from dflash_trt.decoding_modes import DFLASH
    from dflash_trt.executors import trtllm
    from dflash_trt.executors.contract import Request
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.sampling_rules import Sampling

    engine_dir, checkpoint, library = engine
    raw = Sampling(temperature=1.0, seed=7)
    object.__setattr__(raw, "temperature", temperature)  # what `Sampling` would have mapped to 0
    info = trtllm.inspect_engine(engine_dir, DFLASH, str(library))
    backend = trtllm.TrtllmExecutor(info, max_batch_size=len(PROMPTS), end_id=END_ID)
    requests = [Request(input_ids=p, max_new_tokens=MAX_NEW, sampling=raw) for p in PROMPTS]
    trace = asyncio.run(run_load(backend, requests, concurrency=len(requests), timeout_s=600))
    golden = speculative_generate(load_golden_model(checkpoint), PROMPTS, MAX_NEW, stop_token_ids=[END_ID])
    for record in trace.records:
        assert record.error is None and record.output_ids == golden[record.prompt_index].output_ids
