"""The engine network as built for each GPU (trtllm/attention_route.py), run under the emulation, against the golden
model: Hopper (stock attention for the generation passes, DFlashAttention for sliding-window draft layers) and
Blackwell (DFlashAttention for the target's verification and every draft layer, the stock plugin for context
requests only).

The emulated stock plugin refuses what 1.2.x's dispatch cannot run on the emulated GPU (multi-token generation on
SM100 / SM103), so a network routed wrongly for Blackwell fails here as it would at its first generated token.
The DFlashAttention stand-in writes the pool and attends as its kernels do (plugins/include/dflash_trt/).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from _emulation import PROMPTS, STOP, convert, divergences, per_request, sampled_runs
from _pairs import PairVariant
from _speculators_pairs import SpeculatorsVariant, make_speculators_pair

from dflash_trt import cli
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation import plugins
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.functional import EmulationError
from dflash_trt.emulation.stand_ins import load_engine_module
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer
from dflash_trt.trtllm.attention_route import AttentionRoute

TINY_BLOCK = 16
GPUS = ("h100", "b200", "b300")
# Pages of 16 tokens, and a step budget that chunks long prompts with two requests generating.
RUNTIME = {"max_batch_size": 2, "max_num_tokens": 2 * TINY_BLOCK, "tokens_per_block": 16}
# Longer than the sliding drafter's window (6) and than its block (8), and ragged.
LONG_PROMPTS = [list(range(3, 26)), list(range(30, 64)), [9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture
def attention_calls(monkeypatch) -> list[tuple[int, int]]:
    """(layer, rows) of every DFlashAttention stand-in call."""
    calls: list[tuple[int, int]] = []
    original = plugins.AttentionPlugin._execute

    def spy(self, inputs):
        calls.append((self.layer_idx, inputs[0].data.shape[0]))
        return original(self, inputs)

    monkeypatch.setattr(plugins.AttentionPlugin, "_execute", spy)
    return calls


@pytest.fixture(scope="module")
def tiny_prompts(tiny) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny)
    texts = [item.text for item in load_heldout(limit=8)]
    return [tokenizer.encode(t) for t in texts[:3]] + [sum((tokenizer.encode(t) for t in texts[3:6]), [])]


@pytest.fixture(scope="module")
def tiny_golden(tiny, tiny_prompts):
    return speculative_generate(load_golden_model(tiny), tiny_prompts, 24)


@pytest.mark.parametrize("gpu", GPUS)
def test_each_gpu_decodes_the_tiny_pair_like_the_golden_model(gpu, tiny, tiny_prompts, tiny_golden, attention_calls):
    """Greedy, four requests through two slots (the later ones join mid-flight), the long prompt chunked."""
    runtime = EmulatedEngine(tiny, gpu=gpu, **RUNTIME)
    emulated = decode_batch(runtime, tiny_prompts, 24, arrivals=[0, 0, 1, 4])
    assert divergences(tiny, tiny_golden, emulated, 24) == []
    assert runtime.stats.context_chunks > len(tiny_prompts)
    assert max(max(r.acceptance_lengths) for r in emulated) >= 8
    config = runtime.model.config
    served = {layer for layer, rows in attention_calls if rows}
    if gpu == "h100":
        assert attention_calls == []  # no sliding draft layer: everything stays on the stock plugin
    else:  # every target layer's generation rows and every draft layer's block on DFlashAttention
        assert served == set(range(config.num_hidden_layers + config.draft.num_hidden_layers))


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_each_gpu_samples_like_the_golden_model(gpu, tiny, tiny_prompts):
    prompts = [tiny_prompts[0], tiny_prompts[-1], *PROMPTS]
    _, golden, emulated = sampled_runs(tiny, prompts, "mixed", gpu=gpu, max_num_tokens=64, tokens_per_block=16)
    assert divergences(tiny, golden, emulated, 20, per_request("mixed", len(prompts))) == []


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_cli_emulate_for_a_gpu_equals_generate(gpu, tiny, tmp_path, capsys):
    """`emulate --gpu G` prints `generate`'s tokens, greedy and sampled (generate run K tokens further, see
    docs/engine.md §12)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS[:3]))
    args = ["--checkpoint_dir", str(tiny), "--input_file", str(prompts), "--json"]
    for sampled in ([], ["--temperature", "0.8", "--seed", "3"]):
        assert cli.main(["generate", *args, *sampled, "--max_new_tokens", str(30 + TINY_BLOCK - 1)]) == 0
        generated = json.loads(capsys.readouterr().out)["sequences"]
        engine = ["--gpu", gpu, "--max_new_tokens", "30", "--max_batch_size", "2", "--tokens_per_block", "16"]
        assert cli.main(["emulate", *args, *sampled, *engine]) == 0
        emulated = json.loads(capsys.readouterr().out)["sequences"]
        assert [e["output_ids"] for e in emulated] == [g["output_ids"][:30] for g in generated]


def test_cli_emulate_refuses_an_unknown_gpu(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    argv = ["emulate", "--checkpoint_dir", str(tiny), "--input_file", str(prompts), "--gpu", "a100"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "invalid choice: 'a100'" in capsys.readouterr().err


# ------------------------------------------------------------------------ sliding-window drafters past their window

SLIDING = {
    "causal": PairVariant(draft_layers=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "bidirectional": PairVariant(
        draft_layers=2, sliding_window=5, layer_types=["full_attention", "sliding_attention"], is_causal=False
    ),
}


@pytest.fixture(scope="module", params=list(SLIDING))
def sliding_pair(request, tmp_path_factory) -> Path:
    return convert(tmp_path_factory.mktemp(f"sliding-{request.param}"), SLIDING[request.param])


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_sliding_window_drafters_decode_past_their_window(gpu, sliding_pair, attention_calls):
    model = load_golden_model(sliding_pair)
    window = model.draft.spec.sliding_window
    golden = speculative_generate(model, LONG_PROMPTS, 20, STOP)
    runtime = EmulatedEngine(sliding_pair, gpu=gpu, max_batch_size=2, max_num_tokens=24, tokens_per_block=16)
    emulated = decode_batch(runtime, LONG_PROMPTS, 20, STOP, arrivals=[0, 0, 2])
    assert divergences(sliding_pair, golden, emulated, 20) == []
    assert max(len(p) + len(r.output_ids) for p, r in zip(LONG_PROMPTS, emulated, strict=True)) > 3 * window
    sliding_layer = runtime.model.config.num_hidden_layers + model.draft.spec.layer_types.index("sliding_attention")
    assert any(layer == sliding_layer for layer, _ in attention_calls)  # the window runs on DFlashAttention


def test_a_window_left_out_is_caught(sliding_pair, monkeypatch):
    """The sliding layers' DFlashAttention built without its window: the drafts change past the window."""
    engine = load_engine_module()
    original = engine.BlockAttention

    def windowless(**fields):
        return original(**{**fields, "window": None})

    monkeypatch.setattr(engine, "BlockAttention", windowless)
    golden = speculative_generate(load_golden_model(sliding_pair), LONG_PROMPTS, 20, STOP)
    emulated = decode_batch(EmulatedEngine(sliding_pair, gpu="b200", max_batch_size=3), LONG_PROMPTS, 20, STOP)
    assert divergences(sliding_pair, golden, emulated, 20) != []


def test_sampled_sliding_window_drafter(sliding_pair):
    greedy, golden, emulated = sampled_runs(sliding_pair, LONG_PROMPTS, "t0.7", gpu="b300")
    assert divergences(sliding_pair, golden, emulated, 20, per_request("t0.7", len(LONG_PROMPTS))) == []


@pytest.fixture(scope="module")
def speculators_sliding_pair(tmp_path_factory) -> Path:
    """A speculators DFlash2 drafter whose sliding layer (non-causal in the block, the DFlash2 default) counts its
    window of 5 back from the block's anchor."""
    root = tmp_path_factory.mktemp("speculators-sliding")
    variant = SpeculatorsVariant(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    target, draft = make_speculators_pair(root, variant)
    convert_checkpoint(target, draft, root / "ckpt", dtype="float32")
    return root / "ckpt"


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_a_window_counted_from_the_anchor_decodes_past_it(gpu, speculators_sliding_pair):
    model = load_golden_model(speculators_sliding_pair)
    assert model.draft.spec.window_from_anchor
    golden = speculative_generate(model, LONG_PROMPTS, 20 + model.draft.spec.num_drafts, STOP)
    runtime = EmulatedEngine(
        speculators_sliding_pair, gpu=gpu, max_batch_size=2, max_num_tokens=24, tokens_per_block=16
    )
    emulated = decode_batch(runtime, LONG_PROMPTS, 20, STOP, arrivals=[0, 0, 2])
    assert divergences(speculators_sliding_pair, golden, emulated, 20) == []


def test_a_window_counted_from_each_query_instead_is_caught(speculators_sliding_pair, monkeypatch):
    engine = load_engine_module()
    original = engine.BlockAttention

    def from_each_query(**fields):
        return original(**{**fields, "window_from_anchor": False})

    monkeypatch.setattr(engine, "BlockAttention", from_each_query)
    model = load_golden_model(speculators_sliding_pair)
    golden = speculative_generate(model, LONG_PROMPTS, 20 + model.draft.spec.num_drafts, STOP)
    emulated = decode_batch(
        EmulatedEngine(speculators_sliding_pair, gpu="b200", max_batch_size=3), LONG_PROMPTS, 20, STOP
    )
    assert divergences(speculators_sliding_pair, golden, emulated, 20) != []


@pytest.mark.parametrize("gpu", ["h100", "b300"])
def test_the_selftests_windowed_drafter_decodes_past_its_window(gpu, tmp_path, tiny_prompts):
    """`selftest --sliding_window 40`: the embedded drafter with a windowed last layer, as the self-test converts
    it, decodes like the golden model (which applies the window) past the window on both routes."""
    from dflash_trt.commands.selftest import windowed_drafter

    checkpoint = tmp_path / "ckpt"
    convert_checkpoint(target_dir(), windowed_drafter(tmp_path, draft_dir(), 40), checkpoint, dtype="float32")
    model = load_golden_model(checkpoint)
    assert model.draft.spec.layer_types[-1] == "sliding_attention" and model.draft.spec.sliding_window == 40
    golden = speculative_generate(model, tiny_prompts, 24)
    emulated = decode_batch(EmulatedEngine(checkpoint, gpu=gpu, **RUNTIME), tiny_prompts, 24)
    assert divergences(checkpoint, golden, emulated, 24) == []
    assert max(len(p) for p in tiny_prompts) + 24 > 40


# ----------------------------------------------------------------------------------- tensor parallelism, dispatch


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tp2") / "ckpt"
    convert_checkpoint(target_dir(), draft_dir(), out, dtype="float32", tp_size=2)
    return out


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_a_tp2_checkpoint_decodes_like_the_tp1_golden_model(gpu, tiny, tiny_tp2, tiny_prompts, tiny_golden):
    runtime = EmulatedEngine(tiny_tp2, gpu=gpu, **RUNTIME)
    assert runtime.tp_size == 2
    emulated = decode_batch(runtime, tiny_prompts, 24, arrivals=[0, 0, 1, 4])
    assert divergences(tiny, tiny_golden, emulated, 24) == []


@pytest.mark.slow
def test_an_fp8_kv_cache_on_the_blackwell_route(tmp_path, monkeypatch):
    """FP8 weights and an FP8 KV cache on B200: every DFlashAttention call writes and reads FP8 pages with its
    layer's scales, and decoding matches the golden model."""
    pytest.importorskip("modelopt.torch.quantization")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    variant = PairVariant(intermediate=128, draft_intermediate=64)
    ckpt = convert(tmp_path, variant, qformat="fp8", kv_cache_dtype="fp8", calib_dataset=calib, calib_size=4)
    fp8_calls = []
    original = plugins.AttentionPlugin._execute

    def spy(self, inputs):
        fp8_calls.append((self.cache_fp8, len(inputs)))
        return original(self, inputs)

    monkeypatch.setattr(plugins.AttentionPlugin, "_execute", spy)
    golden = speculative_generate(load_golden_model(ckpt), PROMPTS, 10, STOP)
    runtime = EmulatedEngine(ckpt, gpu="b200", max_batch_size=2, max_num_tokens=16, tokens_per_block=16)
    assert divergences(ckpt, golden, decode_batch(runtime, PROMPTS, 10, STOP, arrivals=[0, 0, 1, 2]), 10) == []
    assert fp8_calls and set(fp8_calls) == {(1, 10)}


def test_the_stock_plugin_on_blackwell_fails_as_tensorrt_llm_does(tiny):
    """A network whose generation passes stay on the stock plugin, run on a B200: 1.2.x's assertion."""
    runtime = EmulatedEngine(tiny, gpu="b200")
    for model in runtime.rank_models:
        model.attention_route = AttentionRoute(90)
    with pytest.raises(EmulationError, match="No available XQA kernels are found for speculative decoding mode"):
        decode_batch(runtime, [PROMPTS[0]], 4)


def test_a_split_off_by_one_row_is_caught(tiny, tiny_prompts, tiny_golden, monkeypatch):
    """The context rows cut one row short: the first generation row goes to the stock plugin, the rest shift."""
    engine = load_engine_module()
    module = engine.dflash_attention.__wrapped__.__globals__
    original = module["batch_split"]

    def one_row_short(block, kwargs):
        split = original(block, kwargs)
        return dataclasses.replace(
            split, context_tokens=split.context_tokens - 1, generation_tokens=split.generation_tokens + 1
        )

    monkeypatch.setitem(module, "batch_split", one_row_short)
    runtime = EmulatedEngine(tiny, gpu="b200", **RUNTIME)
    with pytest.raises(EmulationError):
        decode_batch(runtime, tiny_prompts, 24, arrivals=[0, 0, 1, 4])
