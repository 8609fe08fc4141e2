"""FP8 mixture-of-experts weights against modelopt 0.47's stacked-expert TensorRT-LLM export, byte for byte, and
FP8 MoE checkpoints through conversion, verify, TP/EP and calibration.

The oracle quantizes real per-expert `nn.Linear` modules (gate_proj, up_proj, down_proj) with `mtq.quantize`
(FP8_DEFAULT_CFG, max calibration) and runs modelopt's own `build_stacked_experts` (gate/up fusion per expert,
stacking, the per-expert scales) and `to_quantized_weight`, so its edge cases are what we compare against.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _pairs import PairVariant, make_pair
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from dflash_trt.conversion.calibrate import observe_amax
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, NVFP4
from dflash_trt.quant.linears import quantize_weight
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model

mtq = pytest.importorskip("modelopt.torch.quantization")
layer_utils = pytest.importorskip("modelopt.torch.export.layer_utils")
quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")

FC, PROJ = "transformer.layers.0.mlp.fc.weight", "transformer.layers.0.mlp.proj.weight"
VARIANT = PairVariant(
    arch="qwen3_moe",
    moe={
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
)


CASES = ["random", "gate_dominates", "up_dominates", "zero_expert", "tiny_and_huge"]


class _Expert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype) for w in (gate, up, down)
        )
        with torch.no_grad():
            for lin, w in ((self.gate_proj, gate), (self.up_proj, up), (self.down_proj, down)):
                lin.weight.copy_(w)


def _modelopt_stacked(experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    modules = nn.ModuleList(_Expert(*e) for e in experts)
    gen = torch.Generator().manual_seed(1)

    def forward_loop(m: nn.ModuleList) -> None:
        with torch.no_grad():
            for expert in m:
                x = torch.randn(3, expert.gate_proj.in_features, generator=gen).to(expert.gate_proj.weight.dtype)
                expert.down_proj(nn.functional.silu(expert.gate_proj(x)) * expert.up_proj(x))

    mtq.quantize(modules, copy.deepcopy(mtq.FP8_DEFAULT_CFG), forward_loop=forward_loop)
    fc, proj = layer_utils.build_stacked_experts(
        modules, ["gate_proj", "down_proj", "up_proj"], len(experts), layer_utils._get_expert_attr
    )
    out = {}
    for name, cfg in ((FC, fc), (PROJ, proj)):
        out[name] = quant_utils.to_quantized_weight(cfg.weight, cfg.weights_scaling_factor, "fp8")
        out[name.replace("weight", "weights_scaling_factor")] = cfg.weights_scaling_factor
    return out


def _experts(dtype: torch.dtype, case: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(CASES.index(case))
    inter, hidden = 32, 48

    def randn(*shape, scale=0.05):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    experts = [(randn(inter, hidden), randn(inter, hidden), randn(hidden, inter)) for _ in range(4)]
    if case == "gate_dominates":  # one expert's gate amax far above its up: the shared scale re-rounds the up rows
        gate, up, down = experts[1]
        experts[1] = (gate * 40, up, down)
    elif case == "up_dominates":
        gate, up, down = experts[2]
        experts[2] = (gate, up * 40, down)
    elif case == "zero_expert":  # modelopt's zero-amax substitute, per expert
        experts[3] = tuple(torch.zeros_like(w) for w in experts[3])
    elif case == "tiny_and_huge":  # below the smallest normal of fp16 in one expert, near its max in another
        experts[0] = tuple(w * 1e-4 for w in experts[0])
        experts[1] = tuple((w.float() * 100).to(dtype) for w in experts[1])
    return experts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_fp8_experts_are_bit_exact_with_modelopt(dtype, case):
    experts = _experts(dtype, case)
    fc = torch.stack([torch.cat([up, gate]) for gate, up, _ in experts])
    proj = torch.stack([down for _, _, down in experts])
    ours = {**quantize_weight(FC, fc, FP8), **quantize_weight(PROJ, proj, FP8)}
    theirs = _modelopt_stacked(experts)
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        got = ours[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(
            got.view(torch.uint8) if got.element_size() == 1 else got,
            want.view(torch.uint8) if want.element_size() == 1 else want,
        ), name


def test_nvfp4_experts_are_refused():
    with pytest.raises(DFlashTrtError, match="use --qformat fp8 for MoE"):
        quantize_weight(FC, torch.ones(2, 64, 64), NVFP4)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_fp8")
    target_dir, draft_dir = make_pair(root, VARIANT)
    calib = root / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": [3 + i, 4, 5 + i, 6, 7, 9 + i]}) for i in range(6)))
    checkpoints = {}
    for tp, ep in ((1, 1), (4, 2)):
        checkpoints[tp, ep] = root / f"fp8_tp{tp}_ep{ep}"
        convert_checkpoint(
            target_dir,
            draft_dir,
            checkpoints[tp, ep],
            dtype="float32",
            tp_size=tp,
            moe_ep_size=ep,
            qformat="fp8",
            kv_cache_dtype="fp8",
            calib_dataset=calib,
        )
    return target_dir, draft_dir, checkpoints


def test_fp8_moe_checkpoint_verifies_keeps_the_router_and_splits_scales_with_experts(fp8_pair):
    target_dir, draft_dir, checkpoints = fp8_pair
    for ckpt in checkpoints.values():
        report = verify_checkpoint(ckpt, target_dir, draft_dir)
        assert report.ok, report.verdict()
    whole = load_file(checkpoints[1, 1] / "rank0.safetensors")
    hf = load_file(target_dir / "model.safetensors")
    assert torch.equal(whole["transformer.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    assert whole[FC].dtype == torch.float8_e4m3fn and whole[
        "transformer.layers.0.mlp.fc.weights_scaling_factor"
    ].shape == (4, 1)
    for rank in range(4):  # tp 4, moe_ep 2: rank r holds experts of group r % 2
        piece = load_file(checkpoints[4, 2] / f"rank{rank}.safetensors")
        group = rank % 2
        want = whole["transformer.layers.0.mlp.fc.weights_scaling_factor"][2 * group : 2 * group + 2]
        assert torch.equal(piece["transformer.layers.0.mlp.fc.weights_scaling_factor"], want)
        assert torch.equal(
            piece["transformer.layers.0.mlp.fc.activation_scaling_factor"],
            whole["transformer.layers.0.mlp.fc.activation_scaling_factor"],
        )


def test_fp8_moe_shards_decode_like_tp1(fp8_pair):
    _, _, checkpoints = fp8_pair
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    runs = [speculative_generate(load_golden_model(ckpt), prompts, 12) for ckpt in checkpoints.values()]
    assert [(r.output_ids, r.acceptance_lengths) for r in runs[0]] == [
        (r.output_ids, r.acceptance_lengths) for r in runs[1]
    ]


def test_calibration_sees_the_moe_input_of_valid_tokens_only(fp8_pair, tmp_path):
    """The fc input amax of a sparse layer is the largest |input| HF's sparse block receives on the real tokens."""
    target_dir, draft_dir, _ = fp8_pair
    convert_checkpoint(target_dir, draft_dir, tmp_path / "plain", dtype="float32")
    golden = load_golden_model(tmp_path / "plain")
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
    seen = []
    hook = hf.model.layers[0].mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].abs().max()))
    with torch.no_grad():
        for p in prompts:
            hf(torch.tensor([p]))
    hook.remove()
    tokens = torch.tensor([prompts[0], prompts[1] + [0, 0, 0]])
    valid = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    positions = torch.arange(6).expand(2, -1)
    with torch.no_grad(), observe_amax(golden) as amax:
        golden.target.forward(tokens, positions, valid, golden.target.new_cache(2, 8))
    torch.testing.assert_close(
        amax.input_amax("transformer.layers.0.mlp.fc").reshape(()), torch.stack(seen).max(), rtol=1e-6, atol=0
    )
    assert float(amax.input_amax("transformer.layers.0.mlp.proj")) > 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_prequantized_fp8_moe_target_is_carried_over(fp8_pair, tmp_path):
    """modelopt's own PTQ + unified HF export of the MoE target: its per-expert FP8 bytes land in the stacks."""
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import Qwen3MoeForCausalLM

    target_dir, draft_dir, _ = fp8_pair
    model = Qwen3MoeForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, copy.deepcopy(mtq.FP8_DEFAULT_CFG), forward_loop=lambda m: m(input_ids=ids))
    exported = tmp_path / "exported"
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(exported))
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": [i, i + 1, 5, 6]}) for i in range(10, 20)) + "\n")
    for tp, ep in ((1, 1), (4, 2)):
        convert_checkpoint(
            exported,
            draft_dir,
            tmp_path / f"ckpt{tp}",
            dtype="bfloat16",
            tp_size=tp,
            moe_ep_size=ep,
            calib_dataset=calib,
            calib_size=4,
        )
        assert verify_checkpoint(tmp_path / f"ckpt{tp}", exported, draft_dir).ok
    source = load_file(exported / "model.safetensors")
    stored = load_file(tmp_path / "ckpt1" / "rank0.safetensors")
    expert = "model.layers.2.mlp.experts.{}.{}_proj.{}"
    for e in range(4):
        assert torch.equal(
            source[expert.format(e, "gate", "weight_scale")], source[expert.format(e, "up", "weight_scale")]
        )
        want = torch.cat([source[expert.format(e, "up", "weight")], source[expert.format(e, "gate", "weight")]])
        assert torch.equal(stored["transformer.layers.2.mlp.fc.weight"][e].view(torch.uint8), want.view(torch.uint8))
        assert float(stored["transformer.layers.2.mlp.fc.weights_scaling_factor"][e]) == float(
            source[expert.format(e, "gate", "weight_scale")]
        )
    inputs = [float(source[expert.format(e, "down", "input_scale")]) for e in range(4)]
    assert float(stored["transformer.layers.2.mlp.proj.activation_scaling_factor"]) == max(inputs)
    golden = load_golden_model(tmp_path / "ckpt1")
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    spec = speculative_generate(golden, prompts, 12)
    assert [r.output_ids for r in spec] == [
        r.output_ids for r in speculative_generate(golden, prompts, 12, block_size=1)
    ]
    sharded = speculative_generate(load_golden_model(tmp_path / "ckpt4"), prompts, 12)
    assert [r.output_ids for r in sharded] == [r.output_ids for r in spec]
