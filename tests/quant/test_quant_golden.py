"""Quantized checkpoints through the golden model: logit error within the derived bound per format, and
speculative decoding still lossless with respect to the quantized target.

The quantized checkpoint is built the way the converter will: full tensors quantized by `linears.quantize_tensors`,
activation and KV scales from `calibrate_pair` on calibration prompts (the drafter calibrated on the quantized
target's features), written next to the converted config.

Bound (docs/quantization.md §6): a quantized GEMM's output carries the relative rounding error of its weight and
its input, added in quadrature: FP8 E4M3 rounds to 3 mantissa bits (RMS relative error about 2**-4 / sqrt(3)
= 0.036 per operand, 0.051 per GEMM); NVFP4 rounds to E2M1 under per-16 scales (measured RMS about 0.10 per operand,
0.14 per GEMM). Each decoder layer adds two branch outputs (attention, MLP) to the residual stream, each the end of
a chain of two quantized GEMMs (plus, with an FP8 KV cache, the rounding of K and V on the attention branch), so
after L layers the residual, the final norm and the unquantized lm_head carry at most
sqrt(2 L) * sqrt(2 e_gemm**2 [+ 2 e_fp8**2]) relative error when branch and residual norms are comparable.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_trt import formats
from dflash_trt.checkpoint.integrity import INTEGRITY_FILE
from dflash_trt.conversion import calibrate as cal
from dflash_trt.quant import linears
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model, load_rank_tensors

pytest.importorskip("modelopt.torch.quantization")

CALIBRATION = [[3, 4, 5, 6, 7, 8, 9], [20, 21, 22], [40, 41, 42, 43, 44, 45]]
PROMPTS = [[5, 9, 14, 2, 33], [11, 12], [60, 61, 62, 63, 64, 65, 66, 67]]
FP8_OPERAND_ERROR = 2**-4 / math.sqrt(3)
NVFP4_OPERAND_ERROR = 0.10
GEMM_ERROR = {
    "fp8": math.hypot(FP8_OPERAND_ERROR, FP8_OPERAND_ERROR),
    "nvfp4": math.hypot(NVFP4_OPERAND_ERROR, NVFP4_OPERAND_ERROR),
}


def _quantized_checkpoint(source: Path, out: Path, qformat: str, kv_cache_dtype: str, amax=None) -> Path:
    golden = load_golden_model(source)
    if amax is None:
        amax = cal.calibrate_pair(golden, CALIBRATION, 8, qformat, kv_cache_dtype)
    target_spec, draft_spec = golden.target.spec, golden.draft.spec
    tensors = linears.quantize_tensors(load_rank_tensors(source, 1, target_spec, draft_spec), qformat)
    tensors.update(cal.calibration_tensors(amax, qformat, kv_cache_dtype))
    out.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = formats.quantization_config(qformat, kv_cache_dtype)
    config["dflash_config"]["quantization"] = formats.quantization_config(qformat, kv_cache_dtype)
    (out / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "rank0.safetensors"))
    for extra in source.iterdir():
        if extra.name not in ("config.json", "rank0.safetensors", INTEGRITY_FILE):  # a hand-made checkpoint
            shutil.copy(extra, out / extra.name)
    return out


def _target_logits(checkpoint: Path) -> torch.Tensor:
    golden = load_golden_model(checkpoint)
    width = max(len(p) for p in PROMPTS)
    tokens = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        tokens[i, : len(p)] = torch.tensor(p)
    positions = torch.arange(width).expand(len(PROMPTS), -1)
    valid = positions < torch.tensor([len(p) for p in PROMPTS])[:, None]
    with torch.no_grad():
        logits, _ = golden.target.forward(tokens, positions, valid, golden.target.new_cache(len(PROMPTS), width))
    return logits[valid]


@pytest.mark.parametrize("qformat, kv_cache_dtype", [("fp8", "fp8"), ("nvfp4", "none"), ("nvfp4", "fp8")])
def test_logit_error_within_bound_and_lossless(converted: Path, tmp_path: Path, qformat: str, kv_cache_dtype: str):
    quantized = _quantized_checkpoint(converted, tmp_path / "q", qformat, kv_cache_dtype)
    reference, ours = _target_logits(converted), _target_logits(quantized)
    relative = float((ours - reference).norm() / reference.norm())
    layers = load_golden_model(converted).target.spec.num_hidden_layers
    kv = 2 * FP8_OPERAND_ERROR**2 if kv_cache_dtype == "fp8" else 0.0
    bound = math.sqrt(2 * layers) * math.sqrt(2 * GEMM_ERROR[qformat] ** 2 + kv)
    assert 0 < relative < bound, (relative, bound)

    golden = load_golden_model(quantized)
    speculative = speculative_generate(golden, PROMPTS, 16)
    plain = speculative_generate(golden, PROMPTS, 16, block_size=1)
    assert [r.output_ids for r in speculative] == [r.output_ids for r in plain]


def test_in_memory_quantized_model_equals_the_written_checkpoint(converted: Path, tmp_path: Path) -> None:
    """`quantized_model` (used by the acceptance report) runs exactly what loading the quantized checkpoint runs."""
    golden = load_golden_model(converted)
    amax = cal.calibrate_pair(golden, CALIBRATION, 8, "nvfp4", "fp8")
    written = load_golden_model(_quantized_checkpoint(converted, tmp_path / "q", "nvfp4", "fp8", amax))
    on_disk = speculative_generate(written, PROMPTS, 12)
    with cal.quantized_model(golden, "nvfp4", "nvfp4", "fp8", amax):
        in_memory = speculative_generate(golden, PROMPTS, 12)
    plain = speculative_generate(golden, PROMPTS, 12)
    for a, b in zip(on_disk, in_memory, strict=True):
        assert (a.output_ids, a.acceptance_lengths) == (b.output_ids, b.acceptance_lengths)
    assert [r.output_ids for r in plain] != [r.output_ids for r in on_disk]  # the context really quantized
