"""The engine network (`dflash_trt/trtllm/model.py`, unmodified) run under the emulated TensorRT-LLM 1.2.x and
EAGLE runtime loop, against the golden model: the same tokens, acceptance lengths and drafted tokens per step.

The golden model (`speculative_generate`) is the independent side: it never touches the network, the paged pool
or the runtime's packing. Drafted tokens are compared too, because on a random pair almost nothing is accepted
and outputs are lossless whatever the drafter computes; the trained tiny pair accepts long blocks, so the broken
networks below change acceptance as well.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _emulation import PROMPTS, SAMPLED, SAMPLED_TOKENS, STOP, convert, divergences, per_request, sampled_runs
from _pairs import PairVariant
from safetensors.torch import load_file, save_file

from dflash_trt import cli
from dflash_trt.emulation import functional
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.emulation.functional import EmulationError, Network, PluginConfig, net_guard
from dflash_trt.emulation.stand_ins import ENGINE_PACKAGE, ENGINE_SOURCES, REGISTRY, load_engine_module
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import SequenceResult, speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.sampling_rules import TEMPERATURE_RULE
from dflash_trt.tiny.heldout import load_heldout
from dflash_trt.tokenizer import load_tokenizer

TINY_BLOCK = 16  # the embedded drafter's block size

# Every build-compatible fixture variant (sliding-window drafters: tests/emulation/test_emulation_routes.py).
VARIANTS = {
    "qwen3-gqa-b8": (PairVariant(), 16),
    "qwen3-tied-b4-last-tap": (PairVariant(tie=True, block_size=4, taps=[3], draft_layers=1), 32),
    "llama-mqa-bias-headdim": (
        PairVariant(
            arch="llama",
            target_bias=True,
            head_dim=24,
            heads=4,
            kv_heads=1,
            draft_heads=4,
            draft_kv_heads=1,
            draft_head_dim=24,
            draft_bias=True,
        ),
        64,
    ),
    "qwen3-b16-scales-softcap": (
        PairVariant(
            block_size=16,
            taps=[0, 1, 3],
            draft_layers=3,
            dflash_extra={"input_embedding_scale": 1.7, "output_multiplier": 0.6, "final_logit_softcapping": 2.5},
        ),
        16,
    ),
    "llama3-rope-tied": (
        PairVariant(
            arch="llama",
            tie=True,
            rope={
                "rope_type": "llama3",
                "rope_theta": 5000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        32,
    ),
    "qwen3-causal-drafter": (PairVariant(is_causal=True, taps=None, top_level={"block_size": 6}), 16),
    # Drafters with their own RoPE: another theta than the target's, and plain RoPE under a llama3-scaled target.
    "qwen3-drafter-own-theta": (
        PairVariant(
            rope={"rope_type": "default", "rope_theta": 1e6}, draft_rope={"rope_type": "default", "rope_theta": 500.0}
        ),
        16,
    ),
    "llama3-target-plain-drafter": (
        PairVariant(
            arch="llama",
            rope={
                "rope_type": "llama3",
                "rope_theta": 5000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            draft_rope={"rope_type": "default", "rope_theta": 20.0},
        ),
        32,
    ),
}


@pytest.fixture(scope="module")
def tiny_prompts(tiny) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny)
    texts = [item.text for item in load_heldout(limit=12)]
    single = [tokenizer.encode(t) for t in texts[:4]]
    # Long prompts (several problems) are chunked by a small max_num_tokens.
    joined = [sum((tokenizer.encode(t) for t in texts[i : i + 4]), []) for i in (4, 8)]
    return single + joined


@pytest.fixture(scope="module")
def tiny_golden(tiny, tiny_prompts) -> list[SequenceResult]:
    return speculative_generate(load_golden_model(tiny), tiny_prompts, 24)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_fixture_variant_matches_the_golden_model(name, tmp_path):
    variant, tokens_per_block = VARIANTS[name]
    ckpt = convert(tmp_path, variant)
    golden = speculative_generate(load_golden_model(ckpt), PROMPTS, 12, STOP)
    # Two slots for four ragged requests: the last ones join when earlier ones finish.
    runtime = EmulatedEngine(ckpt, max_batch_size=2, tokens_per_block=tokens_per_block)
    emulated = decode_batch(runtime, PROMPTS, 12, STOP)
    assert divergences(ckpt, golden, emulated, 12) == []
    assert runtime.stats.max_batch == 2 and runtime.model.unused_tensors == []


def test_chunked_prompts_and_requests_joining_mid_flight(tiny, tiny_prompts, tiny_golden):
    runtime = EmulatedEngine(tiny, max_batch_size=2, max_num_tokens=2 * TINY_BLOCK, tokens_per_block=16)
    emulated = decode_batch(runtime, tiny_prompts, 24, arrivals=[0, 0, 2, 3, 3, 9])
    assert divergences(tiny, tiny_golden, emulated, 24) == []
    assert runtime.stats.context_chunks > len(tiny_prompts)  # the long prompts took several chunks
    assert max(max(r.acceptance_lengths) for r in emulated) >= 8  # the drafter is really exercised


@pytest.mark.slow
@pytest.mark.parametrize("tokens_per_block", [32, 64])
def test_tokens_per_block(tiny, tiny_prompts, tiny_golden, tokens_per_block):
    runtime = EmulatedEngine(tiny, max_batch_size=3, tokens_per_block=tokens_per_block)
    assert divergences(tiny, tiny_golden, decode_batch(runtime, tiny_prompts, 24), 24) == []


def _prefill_logits(model, prompt: list[int], fp8_context: bool) -> torch.Tensor:
    """The golden target's logits for the last prompt token, the prompt attending in FP8 context FMHA or not."""
    model.target.fp8_context = fp8_context
    positions = torch.arange(len(prompt))[None]
    logits, _ = model.target.forward(
        torch.tensor([prompt]),
        positions,
        torch.ones_like(positions, dtype=torch.bool),
        model.target.new_cache(1, len(prompt)),
        torch.ones(1, dtype=torch.bool),
    )
    model.target.fp8_context = True
    return logits[0, -1]


@pytest.mark.slow
@pytest.mark.parametrize(("qformat", "gpu"), [("fp8", "h200"), ("fp8", "b200"), ("nvfp4", "b300")])
def test_quantized_checkpoints_with_fp8_kv_cache(qformat, gpu, tmp_path, monkeypatch):
    """Decoding agrees (tie-aware), and the prompts' logits show that both sides run the context requests through
    FP8 context attention, its output written as e4m3: the network's context-step logits sit on the golden model's
    FP8-context logits, far closer than the 16-bit-context ones are. On Hopper the stock plugin's FP8 output goes
    straight to the dense layers; on Blackwell its context rows are dequantized to meet DFlashAttention's. NVFP4
    runs on Blackwell only (profiles refuse it on Hopper)."""
    pytest.importorskip("modelopt.torch.quantization")
    from dflash_trt.emulation.engine import EmulatedEngine

    steps = []
    run = EmulatedEngine.run

    def recording(self, inputs, batch_size):
        outputs = run(self, inputs, batch_size)
        steps.append(outputs["logits"].float().clone())
        return outputs

    monkeypatch.setattr(EmulatedEngine, "run", recording)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    ckpt = convert(
        tmp_path,
        PairVariant(intermediate=128, draft_intermediate=64),
        qformat=qformat,
        kv_cache_dtype="fp8",
        calib_dataset=calib,
        calib_size=4,
    )
    model = load_golden_model(ckpt)
    assert model.target.fp8_context  # the engine's context requests attend in FP8 (formats.fp8_context_fmha)
    # The golden loop K tokens further verifies a full block wherever the engine does (reference/divergence.py).
    golden = speculative_generate(model, PROMPTS, 10 + model.draft.spec.block_size - 1, STOP)
    runtime = EmulatedEngine(ckpt, gpu=gpu, max_batch_size=4, tokens_per_block=16)
    assert runtime.cache_dtype == torch.float8_e4m3fn and runtime.plugin_config.use_fp8_context_fmha
    assert divergences(ckpt, golden, decode_batch(runtime, PROMPTS, 10, STOP), 10) == []
    context_step = steps[0]  # every prompt fits the first step: one logits row per context request, in order
    assert context_step.shape[0] == len(PROMPTS)
    for row, prompt in zip(context_step, PROMPTS, strict=True):
        fp8, sixteen_bit = _prefill_logits(model, prompt, True), _prefill_logits(model, prompt, False)
        modelled, unmodelled = (row - fp8).abs().max(), (fp8 - sixteen_bit).abs().max()
        assert unmodelled > 0 and modelled <= 1e-3 * unmodelled, (modelled, unmodelled)


# ------------------------------------------------------------------------------------ deliberately broken networks


@pytest.fixture
def engine():
    return load_engine_module()


def _broken(tiny, tiny_prompts, tiny_golden) -> list[str]:
    """Three requests (one long) through the patched network, compared with the golden model."""
    prompts = [tiny_prompts[0], tiny_prompts[1], tiny_prompts[-1]]
    emulated = decode_batch(EmulatedEngine(tiny, max_batch_size=3, tokens_per_block=16), prompts, 24)
    return divergences(tiny, [tiny_golden[0], tiny_golden[1], tiny_golden[-1]], emulated, 24)


def test_an_off_by_one_in_the_bookkeeping_is_caught(engine, monkeypatch, tiny, tiny_prompts, tiny_golden):
    original = engine.DFlashForCausalLM.bookkeeping

    def off_by_one(self, *args):
        book = original(self, *args)
        return dataclasses.replace(book, positions=book.positions + 1)  # injected K/V one slot late

    monkeypatch.setattr(engine.DFlashForCausalLM, "bookkeeping", off_by_one)
    assert _broken(tiny, tiny_prompts, tiny_golden) != []


def test_a_wrong_draft_pool_layer_offset_is_caught(engine, monkeypatch, tiny, tiny_prompts, tiny_golden):
    original = engine.kv_injection_layer

    def shifted(*args, geometry, **kwargs):
        wrong = dataclasses.replace(geometry, layer_idx_offset=geometry.layer_idx_offset - 1)
        return original(*args, geometry=wrong, **kwargs)

    monkeypatch.setattr(engine, "kv_injection_layer", shifted)
    assert _broken(tiny, tiny_prompts, tiny_golden) != []


def test_a_missing_passthrough_ordering_is_caught(engine, monkeypatch, tiny, tiny_prompts, tiny_golden):
    """The block pass reads ctx_len directly instead of the injection's output: nothing orders it after the write."""
    original = engine.DFlashForCausalLM.write_context

    def unordered(self, context, book, kv_cache_params, slots, valid, passthrough):
        original(self, context, book, kv_cache_params, slots, valid, passthrough)
        return passthrough

    monkeypatch.setattr(engine.DFlashForCausalLM, "write_context", unordered)
    assert _broken(tiny, tiny_prompts, tiny_golden) != []


def test_a_drafter_given_the_targets_rope_tables_is_caught(engine, monkeypatch, tmp_path):
    """The block pass run with the model-wide (target) RoPE tables while the injection used the drafter's own."""
    ckpt = convert(tmp_path, VARIANTS["qwen3-drafter-own-theta"][0])
    model = load_golden_model(ckpt)
    golden = speculative_generate(model, PROMPTS, 12 + model.draft.spec.block_size - 1, STOP)
    original = engine.Attention.fill_attention_params

    def targets_tables(model_cls, params):
        return params if isinstance(model_cls, engine.DFlashDrafter) else original(model_cls, params)

    monkeypatch.setattr(engine.Attention, "fill_attention_params", staticmethod(targets_tables))
    emulated = decode_batch(EmulatedEngine(ckpt, max_batch_size=2, tokens_per_block=16), PROMPTS, 12, STOP)
    assert divergences(ckpt, golden, emulated, 12) != []


# ------------------------------------------------------------------ sampled verification (docs/engine.md §6)


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory) -> Path:
    variant, _ = VARIANTS["qwen3-gqa-b8"]
    return convert(tmp_path_factory.mktemp("random-pair"), variant)


# Small pages and a step budget that chunks the long prompt.
TINY_SAMPLING_RUNTIME = {"tokens_per_block": 16, "max_num_tokens": 2 * TINY_BLOCK}


@pytest.fixture
def tiny_sampling_prompts(tiny_prompts) -> list[list[int]]:
    """Two held-out problems (the second long enough to be chunked) and prompts off the training distribution, where
    the target's entropy is high enough for sampling to change the output."""
    return [tiny_prompts[0], tiny_prompts[-1], *PROMPTS]


@pytest.mark.parametrize("setting", list(SAMPLED))
@pytest.mark.parametrize("pair", ["tiny", "random"])
def test_sampled_decoding_matches_the_golden_model(pair, setting, request):
    if pair == "tiny":
        ckpt, prompts = request.getfixturevalue("tiny"), request.getfixturevalue("tiny_sampling_prompts")
        runtime = TINY_SAMPLING_RUNTIME
    else:
        ckpt, prompts, runtime = request.getfixturevalue("random_pair"), PROMPTS, {}
    greedy, golden, emulated = sampled_runs(ckpt, prompts, setting, **runtime)
    temperatures = per_request(setting, len(prompts))
    assert divergences(ckpt, golden, emulated, SAMPLED_TOKENS, temperatures) == []
    # Sampling really happened, and a greedy request in the mixed batch decodes exactly greedily.
    assert any(g.output_ids != e.output_ids for g, e, t in zip(greedy, emulated, temperatures, strict=True) if t)
    assert all(g.output_ids == e.output_ids for g, e, t in zip(greedy, emulated, temperatures, strict=True) if not t)
    if pair == "tiny":
        assert max(max(e.acceptance_lengths) for e in emulated) >= 8  # long blocks accepted while sampling


def _rolled_uniforms(original):
    """rand_data_validation shifted by one position: slot j verified with the uniform of slot j + 1."""

    def verify(logits, draft_tokens, draft_lens, temperature, rand_data_validation, rand_data_sample, *rest):
        shifted = functional.Tensor(data=rand_data_validation.data.roll(-1, dims=1))
        return original(logits, draft_tokens, draft_lens, temperature, shifted, rand_data_sample, *rest)

    return verify


def _first_token_from_validation_row(original):
    """A context request's first token drawn with its (stale) rand_data_validation row instead of rand_data_sample."""

    def verify(logits, draft_tokens, draft_lens, temperature, rand_data_validation, rand_data_sample, *rest):
        column = functional.Tensor(data=rand_data_validation.data[:, 0].clone())
        return original(logits, draft_tokens, draft_lens, temperature, rand_data_validation, column, *rest)

    return verify


@pytest.mark.parametrize("breakage", [_rolled_uniforms, _first_token_from_validation_row], ids=lambda f: f.__name__)
def test_a_broken_sampled_verification_is_caught(engine, monkeypatch, tiny, tiny_sampling_prompts, breakage):
    monkeypatch.setattr(engine, "verify_drafts", breakage(engine.verify_drafts))
    _, golden, emulated = sampled_runs(tiny, tiny_sampling_prompts, "mixed", **TINY_SAMPLING_RUNTIME)
    temperatures = per_request("mixed", len(tiny_sampling_prompts))
    assert divergences(tiny, golden, emulated, SAMPLED_TOKENS, temperatures) != []


def test_cli_emulate_samples_like_generate(tiny, tmp_path, capsys):
    """`emulate --temperature T --seed S` against `generate` with the same flags and K more tokens (see
    divergences): the same tokens, and the same acceptance lengths up to the engine's clipped last step."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS[:3]))
    args = ["--checkpoint_dir", str(tiny), "--input_file", str(prompts), "--json"]
    sampled = ["--temperature", "0.7", "--seed", "9"]
    assert cli.main(["generate", *args, *sampled, "--max_new_tokens", str(40 + TINY_BLOCK - 1)]) == 0
    generated = json.loads(capsys.readouterr().out)
    engine = ["--max_new_tokens", "40", "--max_batch_size", "2", "--tokens_per_block", "16"]
    assert cli.main(["emulate", *args, *sampled, *engine]) == 0
    emulated = json.loads(capsys.readouterr().out)
    assert cli.main(["emulate", *args, *engine]) == 0
    greedy = json.loads(capsys.readouterr().out)
    for g, e in zip(generated["sequences"], emulated["sequences"], strict=True):
        assert e["output_ids"] == g["output_ids"][:40]
        steps = len(e["acceptance_lengths"])
        assert e["acceptance_lengths"][:-1] == g["acceptance_lengths"][: steps - 1]
    assert [s["output_ids"] for s in greedy["sequences"]] != [s["output_ids"] for s in emulated["sequences"]]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-0.5"], f"argument --temperature: must be {TEMPERATURE_RULE}, got '-0.5'"),
        (["--temperature", "nan"], f"argument --temperature: must be {TEMPERATURE_RULE}, got 'nan'"),
        (["--seed", "-1"], "argument --seed: must be an integer in [0, 9223372036854775807], got '-1'"),
    ],
)
def test_cli_emulate_refuses_sampling_the_engine_cannot_honour(tmp_path, capsys, flags, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    argv = ["emulate", "--checkpoint_dir", str(tmp_path / "ckpt"), "--input_file", str(prompts), *flags]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-trt emulate: error:") and message in err[0]


# ----------------------------------------------------------------------------------- engine facts the emulation checks


def test_bookkeeping_keeps_cumsum_on_batch_length_vectors(tiny, tiny_prompts):
    """No [tokens, tokens] cumsum intermediates (TensorRT would reserve them as activation memory)."""
    runtime = EmulatedEngine(tiny, max_batch_size=2, tokens_per_block=16)
    decode_batch(runtime, tiny_prompts[-2:], 4)
    assert max(len(p) for p in tiny_prompts[-2:]) > 2
    assert runtime.stats.largest_cumsum_square <= 2 * 2


def test_target_qk_norms_use_the_config_epsilon(tiny, engine):
    runtime = EmulatedEngine(tiny)
    eps = runtime.model.config.norm_epsilon
    assert eps == 1e-6
    for layer in runtime.model.transformer.layers:
        assert layer.attention.q_layernorm.eps == eps and layer.attention.k_layernorm.eps == eps
    # The stock layer alone keeps Attention's default, which is why model.py sets it.
    from dflash_trt.emulation.models import QWenDecoderLayer

    stock = QWenDecoderLayer(runtime.model.config.target_config(), 0)
    assert stock.attention.q_layernorm.eps == 1e-5


def test_strict_loading_by_tensorrt_llm_names(tiny, tmp_path):
    import shutil

    def edited(name: str, edit) -> Path:
        out = tmp_path / name
        shutil.copytree(tiny, out)
        tensors = load_file(out / "rank0.safetensors")
        edit(tensors)
        save_file(tensors, out / "rank0.safetensors")
        return out

    missing = edited("missing", lambda t: t.pop("dflash.layers.0.attention.k_layernorm.weight"))
    with pytest.raises(EmulationError, match="Required but not provided.*k_layernorm"):
        EmulatedEngine(missing)
    misshaped = edited("misshaped", lambda t: t.update({"dflash.fc.weight": t["dflash.fc.weight"][:, 1:].clone()}))
    with pytest.raises(EmulationError, match="dflash.fc.weight"):
        EmulatedEngine(misshaped)
    extra = edited("extra", lambda t: t.update({"dflash.unused": torch.zeros(2)}))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert EmulatedEngine(extra).model.unused_tensors == ["dflash.unused"]


def engine_imports() -> set[str]:
    """What the engine's sources take from tensorrt / tensorrt_llm: `from M import x` as `M.x`, `import M as m`
    followed by `m.x` as `M.x` (function-level imports included)."""
    external = ("tensorrt", "tensorrt_llm")
    found: set[str] = set()
    for source in ENGINE_SOURCES:
        tree = ast.parse((ENGINE_PACKAGE / f"{source}.py").read_text())
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in external:
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name: a.name for a in node.names if a.name.split(".")[0] in external}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                found.add(f"{modules[node.value.id]}.{node.attr}")
    return found


def test_the_registry_emulates_exactly_what_the_engine_imports():
    registered = {f"{module}.{name}" for module, symbols in REGISTRY.items() for name in symbols}
    assert registered == engine_imports()
    assert "tensorrt_llm.functional.exp" in registered and "tensorrt.int32" in registered  # the walk sees both kinds


def test_stand_ins_are_visible_only_inside_the_emulation(tiny):
    decode_batch(EmulatedEngine(tiny), [[5, 6, 7]], 3)
    assert "tensorrt_llm" not in sys.modules and "tensorrt" not in sys.modules
    assert importlib.util.find_spec("tensorrt_llm") is None


def full_block_steps(acceptance: list[int], max_new_tokens: int, block: int) -> int:
    """How many leading steps the golden loop verified a full block (at least `block - 1` tokens still to go)."""
    produced, steps = 1, 0
    for accepted in acceptance:
        if max_new_tokens - produced + 1 < block:
            break
        produced, steps = produced + accepted, steps + 1
    return steps


def test_cli_emulate_prints_generates_schema(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS[:3]))
    args = ["--checkpoint_dir", str(tiny), "--input_file", str(prompts), "--max_new_tokens", "40", "--json"]
    assert cli.main(["generate", *args]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert cli.main(["emulate", *args, "--max_batch_size", "2", "--tokens_per_block", "16"]) == 0
    emulated = json.loads(capsys.readouterr().out)
    for g, e in zip(generated["sequences"], emulated["sequences"], strict=True):
        assert e["output_ids"] == g["output_ids"]
        full = full_block_steps(g["acceptance_lengths"], 40, TINY_BLOCK)
        assert full > 0 and e["acceptance_lengths"][:full] == g["acceptance_lengths"][:full]


def test_cli_emulate_bad_input_is_one_error_line(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    assert cli.main(["emulate", "--checkpoint_dir", str(tmp_path / "nothing"), "--input_file", str(prompts)]) == 2
    assert (
        cli.main(
            [
                "emulate",
                "--checkpoint_dir",
                str(tiny),
                "--input_file",
                str(prompts),
                "--max_batch_size",
                "4",
                "--max_num_tokens",
                "8",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("dflash-trt emulate: error:") for line in err)


# --------------------------------------------------------------------------- stand-in ops (1.2.x rules, hand values)


def _t(values, dtype=torch.int32) -> functional.Tensor:
    return functional.Tensor(data=torch.tensor(values, dtype=dtype))


def test_functional_dtype_and_broadcast_rules():
    with net_guard(Network(PluginConfig())):
        assert functional.shape(_t([[1, 2, 3]])).data.dtype == torch.int64
        assert functional.shape(_t([[1, 2, 3]]), 1).data.tolist() == 3  # 0-D
        mixed = _t([1, 2]) + functional.shape(_t([5, 6]), 0)  # int32 + int64 -> int64
        assert mixed.data.dtype == torch.int64 and mixed.data.tolist() == [3, 4]
        assert functional.concat([functional.shape(_t([[1]]), 0), 7]).data.tolist() == [1, 7]  # the int becomes int64
        with pytest.raises(EmulationError, match="concat of different types"):
            functional.concat([_t([1]), functional.shape(_t([1]))])
        with pytest.raises(EmulationError, match="condition must be bool"):
            functional.where(_t([1, 0]), 1, 2)
        with pytest.raises(EmulationError, match="different types"):
            _t([1.0], torch.float32) + _t([1])
        assert functional.where(_t([1, 0]) > 0, 1, _t([7, 8])).data.tolist() == [1, 8]
        assert functional.arange(_t(0), functional.shape(_t([4, 5, 6]), 0), "int32").data.tolist() == [0, 1, 2]
        assert functional.expand(_t([[3]]), functional.concat([2, 3])).data.tolist() == [[3, 3, 3], [3, 3, 3]]
        net = functional.default_net()
        assert functional.cumsum(_t([1, 2, 3, 4]), 0, prefer_plugin=False).data.tolist() == [1, 3, 6, 10]
        assert net.cumsum_square_elements == [16]
        assert functional.argmax(_t([[0.1, 0.9, 0.2]], torch.float32), -1, keepdim=True).data.dtype == torch.int32


def test_functional_ops_of_the_sampled_verification():
    with net_guard(Network(PluginConfig())):
        logits = _t([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0]], torch.float32)
        assert functional.max(logits, 1, keepdim=True).data.tolist() == [[3.0], [0.5]]
        assert functional.max(_t([[-1, -3, -2]]), 1).data.tolist() == [-1]  # int32 stays int32 (IReduceLayer)
        assert functional.max(_t([[-1, -3, -2]]), 1).data.dtype == torch.int32
        assert functional.exp(_t([0.0, 1.0], torch.float32)).data.tolist() == pytest.approx([1.0, 2.718281828])
        with pytest.raises(EmulationError, match="exp of a INT32"):
            functional.exp(_t([1]))
        with pytest.raises(EmulationError, match="max of a bool"):
            functional.max(_t([True], torch.bool), 0)
        assert (_t([1.0], torch.float32) / _t([[4.0], [2.0]], torch.float32)).data.tolist() == [[0.25], [0.5]]
        assert functional.eq(_t([[1, 2]]), _t([2])).data.tolist() == [[False, True]]
        assert functional.minimum(_t([[1, 5]]), 3).data.tolist() == [[1, 3]]
        assert logits.size(-1) == 3 and logits.size() == (2, 3)
        # CumsumLastDim: any rank through a rank-2 view, the input's dtype, no [n, n] intermediates.
        assert functional.cumsum(_t([1, 2, 3]), 0).data.tolist() == [1, 3, 6]
        assert functional.cumsum(_t([[[1, 2], [3, 4]]]), -1).data.tolist() == [[[1, 3], [3, 7]]]
        assert functional.cumsum(logits, 1).data.dtype == torch.float32
        assert functional.default_net().cumsum_square_elements == []
        with pytest.raises(EmulationError, match="CumsumLastDim plugin does not take INT64"):
            functional.cumsum(functional.shape(_t([[1, 2]])), 0)
        # Another dimension: the loop, any numeric type.
        assert functional.cumsum(_t([[1, 2], [3, 4]]), 0).data.tolist() == [[1, 2], [4, 6]]


def test_engine_config_is_the_converters_typed_spec(tiny):
    """DFlashConfig parses the drafter once into the converter's DraftSpec; the engine's config.json stays plain."""
    from dflash_trt.checkpoint.trtllm_config import specs_from_config

    raw = json.loads((tiny / "config.json").read_text())
    config = EmulatedEngine(tiny).model.config
    assert config.draft == specs_from_config(raw)[1]
    written = json.loads(json.dumps(config.to_dict()))
    assert "draft" not in written and written["dflash_config"] == raw["dflash_config"]
    assert type(config).from_dict(written).draft == config.draft
