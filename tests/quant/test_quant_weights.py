"""FP8 / NVFP4 weight quantizers against modelopt 0.47's own TensorRT-LLM export path, byte for byte.

The oracle quantizes real `nn.Linear` modules with `mtq.quantize` (FP8_DEFAULT_CFG / NVFP4_DEFAULT_CFG, max
calibration) and runs the functions its TensorRT-LLM exporter runs per linear (`get_weight_scaling_factor`,
`get_weight_scaling_factor_2`, `to_quantized_weight`, and `preprocess_linear_fusion` for fused GEMMs), so every
edge case the exporter has (amax sanitising, clamping, rounding) is what we compare against.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dflash_trt.errors import DFlashTrtError
from dflash_trt.quant import fp8 as fp8_module
from dflash_trt.quant import nvfp4 as nvfp4_module
from dflash_trt.quant.fp8 import dequantize_fp8, fp8_weight_scale, quantize_fp8, quantize_fp8_shared
from dflash_trt.quant.nvfp4 import (
    dequantize_nvfp4,
    nvfp4_global_scale,
    quantize_nvfp4,
    quantize_nvfp4_shared,
    unpack_e2m1,
)

mtq = pytest.importorskip("modelopt.torch.quantization")
quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8, NVFP4 = "fp8", "nvfp4"


# ---------------------------------------------------------------------------------------------- oracle
def _quantized_linears(weights: dict[str, torch.Tensor], qformat: str) -> dict[str, nn.Linear]:
    """One calibrated modelopt-quantized nn.Linear per weight (one `mtq.quantize` call for all of them)."""
    model = nn.ModuleDict()
    for name, w in weights.items():
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        model[name] = lin
    gen = torch.Generator().manual_seed(1)

    def forward_loop(m: nn.ModuleDict) -> None:
        with torch.no_grad():
            for lin in m.values():
                lin(torch.randn(2, lin.in_features, generator=gen).to(lin.weight.dtype))

    cfg = mtq.FP8_DEFAULT_CFG if qformat == FP8 else mtq.NVFP4_DEFAULT_CFG
    mtq.quantize(model, copy.deepcopy(cfg), forward_loop=forward_loop)
    return dict(model.items())


def _export_linear(lin: nn.Linear) -> dict[str, torch.Tensor]:
    """What modelopt's TensorRT-LLM exporter writes for one linear (build_linear_config + pack_linear_weights)."""
    fmt = quant_utils.get_quantization_format(lin)
    scale = quant_utils.get_weight_scaling_factor(lin)
    scale_2 = quant_utils.get_weight_scaling_factor_2(lin)
    weight = quant_utils.to_quantized_weight(
        lin.weight.detach(), scale, fmt, scale_2, quant_utils.get_weight_block_size(lin)
    )
    out = {"weight": weight, "weights_scaling_factor": scale}
    if scale_2 is not None:
        out["weights_scaling_factor_2"] = scale_2
    return out


def _oracle(weights: dict[str, torch.Tensor], qformat: str) -> dict[str, dict[str, torch.Tensor]]:
    return {name: _export_linear(lin) for name, lin in _quantized_linears(weights, qformat).items()}


def _oracle_fused(weights: list[torch.Tensor], qformat: str) -> list[dict[str, torch.Tensor]]:
    lins = list(_quantized_linears({f"m{i}": w for i, w in enumerate(weights)}, qformat).values())
    quant_utils.preprocess_linear_fusion(lins)
    return [_export_linear(lin) for lin in lins]


def _ours(w: torch.Tensor, qformat: str) -> dict[str, torch.Tensor]:
    q = quantize_fp8(w) if qformat == FP8 else quantize_nvfp4(w)
    return vars(q)


def _assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], label: str) -> None:
    assert ours.keys() == theirs.keys(), label
    for key, mine in ours.items():
        ref = theirs[key]
        assert mine.dtype == ref.dtype, f"{label}.{key}: {mine.dtype} != {ref.dtype}"
        assert mine.shape == ref.shape, f"{label}.{key}: {tuple(mine.shape)} != {tuple(ref.shape)}"
        a, b = mine.contiguous(), ref.contiguous()
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        else:
            a, b = a.view(torch.int32), b.view(torch.int32)
        mismatch = int((a != b).sum())
        assert mismatch == 0, f"{label}.{key}: {mismatch} of {a.numel()} differ"


# ---------------------------------------------------------------------------------------------- cases
def _ties_block() -> torch.Tensor:
    """Rows whose scaled values land exactly on E2M1 rounding ties and grid points.

    Global amax 2688 makes weights_scaling_factor_2 exactly 1; a block with amax 6 then gets block scale 1, so the
    scaled value equals the weight."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.1, 5.9]
    row = torch.tensor(ties + [-t for t in ties] + [2688.0] + [0.0] * 15)
    return torch.stack([row, row.roll(16), -row, row * 0.5]).reshape(4, -1)


def _cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    tiny = torch.finfo(dtype).tiny
    cases = {
        "random": randn(48, 64) * 0.02,
        "wide": randn(8, 1024),
        "tall_chunked": randn(700, 128) * 0.05,
        "zero_block": torch.cat([randn(16, 16), torch.zeros(16, 16), randn(16, 32)], dim=1),
        "zero_row": torch.cat([torch.zeros(1, 64), randn(15, 64)]),
        "equal_blocks": torch.full((8, 64), 0.37),
        "equal_negative": torch.full((8, 32), -1.5e-3),
        "alternating": torch.tensor([1.0, -1.0]).repeat(16, 16),
        "outlier": randn(32, 64).index_put_((torch.tensor([3]), torch.tensor([5])), torch.tensor(6.0e4)),
        "row_magnitudes": randn(16, 64) * torch.logspace(-4, 4, 16).unsqueeze(1),
        "below_smallest_normal": randn(16, 32) * tiny * 0.25,
        "mixed_subnormal": torch.cat([randn(8, 32) * tiny * 0.1, randn(8, 32)]),
        "negative_zero": torch.where(randn(16, 32) > 0, torch.tensor(-0.0), randn(16, 32) * 1e-3),
        "tiny_negatives": torch.cat([torch.full((4, 16), -1e-6), torch.full((4, 16), 1.0)], dim=1),
        "ties": _ties_block(),
    }
    return {name: w.to(dtype) for name, w in cases.items()}


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.filterwarnings("ignore:.*amax entries.*:UserWarning")
@pytest.mark.parametrize("qformat", [FP8, NVFP4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bit_exact_with_modelopt(qformat: str, dtype: torch.dtype) -> None:
    cases = _cases(dtype)
    if qformat == FP8:
        cases["all_zero"] = torch.zeros(8, 32, dtype=dtype)
    reference = _oracle(cases, qformat)
    for name, w in cases.items():
        _assert_same_tensors(_ours(w, qformat), reference[name], f"{qformat}/{dtype}/{name}")


@pytest.mark.parametrize("qformat", [FP8, NVFP4])
def test_chunk_boundaries_do_not_change_bytes(qformat: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantizers work in row chunks; tiny chunks (one row, and a ragged last chunk) give the same bytes."""
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(37, 64, generator=gen) * 0.1).to(torch.bfloat16)
    reference = _oracle({"w": w}, qformat)["w"]
    module = fp8_module if qformat == FP8 else nvfp4_module
    for chunk in (1, 100, 1000):
        monkeypatch.setattr(module, "_CHUNK_ELEMENTS", chunk)
        _assert_same_tensors(_ours(w, qformat), reference, f"{qformat}/chunk{chunk}")


@pytest.mark.parametrize("qformat", [FP8, NVFP4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_shared_scale_matches_modelopt_fusion(qformat: str, dtype: torch.dtype) -> None:
    """mlp.fc + mlp.gate (and q, k, v) share the larger scale, exactly as modelopt's fusion preprocessing."""
    gen = torch.Generator().manual_seed(2)
    weights = [(torch.randn(32, 64, generator=gen) * s).to(dtype) for s in (0.01, 0.3, 0.05)]
    ours = quantize_fp8_shared(weights) if qformat == FP8 else quantize_nvfp4_shared(weights)
    reference = _oracle_fused(weights, qformat)
    for i, (mine, ref) in enumerate(zip(ours, reference, strict=True)):
        _assert_same_tensors(vars(mine), ref, f"{qformat}/{dtype}/member{i}")
    key = "weights_scaling_factor" if qformat == FP8 else "weights_scaling_factor_2"
    shared = {float(getattr(q, key)) for q in ours}
    assert len(shared) == 1 and shared.pop() == max(float(_ours(w, qformat)[key]) for w in weights)


def test_fused_qkv_equals_shared_members() -> None:
    """Quantizing the concatenated qkv equals quantizing q, k, v with one shared scale, for both formats."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 64, generator=gen).to(torch.bfloat16) * s for n, s in ((64, 0.1), (32, 1.0), (32, 0.2)))
    fused = torch.cat([q, k, v])
    fp8 = quantize_fp8(fused)
    parts = quantize_fp8_shared([q, k, v])
    assert torch.equal(fp8.weight.view(torch.uint8), torch.cat([p.weight for p in parts]).view(torch.uint8))
    nv = quantize_nvfp4(fused)
    nv_parts = quantize_nvfp4_shared([q, k, v])
    assert torch.equal(nv.weight, torch.cat([p.weight for p in nv_parts]))
    assert torch.equal(
        nv.weights_scaling_factor.view(torch.uint8),
        torch.cat([p.weights_scaling_factor for p in nv_parts]).view(torch.uint8),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_shapes_and_scales_nvfp4(dtype: torch.dtype) -> None:
    """Random shapes and magnitudes over many orders of magnitude, against modelopt's quantizer."""
    gen = torch.Generator().manual_seed(4)
    cases = {}
    for i in range(12):
        rows = int(torch.randint(1, 40, (1,), generator=gen))
        blocks = int(torch.randint(1, 9, (1,), generator=gen))
        magnitude = 10 ** float(torch.empty(1).uniform_(-6, 3, generator=gen))
        w = torch.randn(rows, blocks * 16, generator=gen) * magnitude
        w = w * (torch.rand(rows, blocks * 16, generator=gen) > 0.1)
        cases[f"c{i}"] = w.to(dtype)
    reference = _oracle(cases, NVFP4)
    for name, w in cases.items():
        _assert_same_tensors(_ours(w, NVFP4), reference[name], f"{dtype}/{name}")


def test_nvfp4_all_zero_weight_dequantizes_to_zero() -> None:
    """modelopt exports NaN scales here (0/0); ours stay finite and decode to exact zeros."""
    zeros = torch.zeros(4, 32, dtype=torch.bfloat16)
    theirs = _oracle({"zeros": zeros}, NVFP4)["zeros"]
    assert bool(theirs["weights_scaling_factor"].float().isnan().all())
    q = quantize_nvfp4(zeros)
    assert torch.equal(q.weights_scaling_factor_2, torch.tensor(1 / 448, dtype=torch.float32))
    assert torch.equal(q.weights_scaling_factor.float(), torch.ones(4, 2))
    assert torch.equal(q.weight, torch.zeros(4, 16, dtype=torch.uint8))
    decoded = dequantize_nvfp4(q.weight, q.weights_scaling_factor, q.weights_scaling_factor_2)
    assert torch.equal(decoded, torch.zeros(4, 32))


def test_nibble_order_and_codes_by_hand() -> None:
    """Element 2k in the low nibble, 2k+1 in the high one; sign in bit 3 (hand-computed bytes)."""
    row = torch.tensor([0.5, -6.0, 1.0, 3.0] + [0.0] * 12) * (2688.0 / 6.0)
    w = torch.stack([row, torch.full((16,), 0.0)]).float()
    w[1, 0] = 2688.0  # second row: block amax 2688 -> global amax 2688 -> scale_2 == 1.
    q = quantize_nvfp4(w)
    assert float(q.weights_scaling_factor_2) == 1.0
    # Row 0: amax 2688 -> block scale 448; scaled values 0.5, -6, 1, 3 -> codes 1, 0xF, 2, 5.
    assert q.weight[0, :2].tolist() == [0xF1, 0x52]
    assert q.weight[1, 0] == 0x07 and float(q.weights_scaling_factor[1, 0]) == 448.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_matches_modelopt(dtype: torch.dtype) -> None:
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(24, 96, generator=gen) * 0.1).to(dtype)
    nv = quantize_nvfp4(w)
    theirs = NVFP4QTensor(w.shape, torch.float32, nv.weight).dequantize(
        dtype=torch.float32,
        scale=nv.weights_scaling_factor,
        double_scale=nv.weights_scaling_factor_2,
        block_sizes={-1: 16},
    )
    assert torch.equal(dequantize_nvfp4(nv.weight, nv.weights_scaling_factor, nv.weights_scaling_factor_2), theirs)
    fp8 = quantize_fp8(w)
    theirs = quant_utils.from_quantized_weight(fp8.weight, fp8.weights_scaling_factor, "fp8", torch.float32)
    assert torch.equal(dequantize_fp8(fp8.weight, fp8.weights_scaling_factor), theirs)
    # FP8 E4M3 rounding: at most half an ulp, 2**-4 relative for normals, 2**-10 x scale below them.
    err = (dequantize_fp8(fp8.weight, fp8.weights_scaling_factor) - w.float()).abs()
    assert bool((err <= w.float().abs() * 2**-4 + float(fp8.weights_scaling_factor) * 2**-10).all())


def test_unpack_e2m1_table() -> None:
    packed = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    values = unpack_e2m1(packed)
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = [[(-1) ** (c >> 3) * grid[c & 7] for b in range(256) for c in (b & 15, b >> 4)]]
    assert values.tolist() == expected


def test_scale_formulas_by_hand() -> None:
    assert fp8_weight_scale(torch.tensor(448.0)).tolist() == [1.0]
    assert fp8_weight_scale(torch.tensor(0.0)).tolist() == [1.0]
    assert fp8_weight_scale(torch.tensor(1e-7, dtype=torch.float16)).item() == pytest.approx(2**-14 / 448)
    assert float(nvfp4_global_scale(torch.tensor(2688.0))) == 1.0
    assert math.isclose(float(nvfp4_global_scale(torch.tensor(1.0))), 1 / 2688, rel_tol=1e-7)


BAD_WEIGHTS = {
    "nan": (torch.tensor([[float("nan")] + [0.0] * 15]), "cannot quantize a weight holding inf or NaN values"),
    "inf": (torch.tensor([[1.0] * 15 + [float("-inf")]]), "cannot quantize a weight holding inf or NaN values"),
    "int": (
        torch.ones(2, 16, dtype=torch.int32),
        r"cannot quantize a torch\.int32 tensor; expected float32, float16 or bfloat16",
    ),
    "1d": (torch.ones(16), r"cannot quantize a tensor of shape \(16,\); expected \(out, in\)"),
    "empty": (torch.ones(0, 16), "cannot quantize an empty weight"),
}


@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_nvfp4])
@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_bad_weights_are_refused(quantize, case: str) -> None:
    weight, message = BAD_WEIGHTS[case]
    with pytest.raises(DFlashTrtError, match=f"^{message}\\.$"):
        quantize(weight)


def test_nvfp4_refuses_partial_blocks() -> None:
    with pytest.raises(DFlashTrtError, match="divisible by 16"):
        quantize_nvfp4(torch.ones(4, 40))


def test_operand_rounding_error_used_by_the_logit_bound() -> None:
    """RMS relative rounding error on Gaussian data: FP8 below 2**-4 / sqrt(3), NVFP4 below 0.10 (the per-operand
    figures test_quant_golden's bound is built from)."""
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(7))
    fp8 = quantize_fp8(w)
    fp8_error = float((dequantize_fp8(fp8.weight, fp8.weights_scaling_factor) - w).norm() / w.norm())
    nv = quantize_nvfp4(w)
    decoded = dequantize_nvfp4(nv.weight, nv.weights_scaling_factor, nv.weights_scaling_factor_2)
    nv_error = float((decoded - w).norm() / w.norm())
    assert 0.01 < fp8_error < 2**-4 / math.sqrt(3)
    assert 0.05 < nv_error < 0.10


_E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1, 0.0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_property_nvfp4_and_fp8_match_modelopt_primitives() -> None:
    """Hypothesis-chosen shapes, dtypes and values (subnormals, ties, extremes) against modelopt's export
    primitives: NVFP4QTensor's scale and packing functions, and FP8's amax / 448 then `to_quantized_weight`."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    values = st.one_of(
        st.floats(-6e4, 6e4, allow_nan=False, allow_infinity=False, width=32),
        st.sampled_from([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1e-40, -1e-7, 2688.0]),
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        rows=st.integers(1, 6),
        blocks=st.integers(1, 3),
        dtype=st.sampled_from(DTYPES),
        data=st.data(),
    )
    def check(rows: int, blocks: int, dtype: torch.dtype, data) -> None:
        # Structured draws make every scale exactly 1 (global amax 2688, each block's amax 6), so the drawn
        # values are the scaled values and E2M1 rounding ties are hit exactly.
        structured = data.draw(st.booleans())
        elements = st.one_of(st.sampled_from(_E2M1_TIES), st.floats(-6, 6, width=32)) if structured else values
        flat = data.draw(st.lists(elements, min_size=rows * blocks * 16, max_size=rows * blocks * 16))
        w = torch.tensor(flat, dtype=torch.float32).reshape(rows, blocks * 16)
        if structured:
            w[:, ::16] = 6.0
            w[0, 0] = 2688.0
        w = w.to(dtype)
        if not bool(torch.isfinite(w).all()) or not bool((w != 0).any()):
            return
        scale_2 = NVFP4QTensor.get_weights_scaling_factor_2(w)
        scale = NVFP4QTensor.get_weights_scaling_factor(w, 16, scale_2)[0]
        packed = quant_utils.to_quantized_weight(w, scale, "nvfp4", scale_2, 16)
        ours = quantize_nvfp4(w)
        assert torch.equal(ours.weight, packed)
        assert torch.equal(ours.weights_scaling_factor.view(torch.uint8), scale.view(torch.uint8))
        assert torch.equal(ours.weights_scaling_factor_2, scale_2)
        amax = w.abs().max().clamp(min=torch.finfo(dtype).tiny)
        fp8_scale = (amax.float() / 448.0).reshape(1)
        fp8 = quantize_fp8(w)
        assert torch.equal(fp8.weights_scaling_factor, fp8_scale)
        reference = quant_utils.to_quantized_weight(w, fp8_scale, "fp8")
        assert torch.equal(fp8.weight.view(torch.uint8), reference.view(torch.uint8))

    check()
