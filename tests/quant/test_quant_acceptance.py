"""The acceptance report's table: every format combination, and speculative decoding's losslessness visible in it
(a quantized drafter never changes the output of an unquantized target)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _pairs import make_pair

from dflash_trt.conversion.acceptance import acceptance_table, markdown
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.model import load_golden_model

pytest.importorskip("modelopt.torch.quantization")


def test_acceptance_table(tmp_path: Path) -> None:
    convert_checkpoint(*make_pair(tmp_path), tmp_path / "ckpt", dtype="bfloat16")
    model = load_golden_model(tmp_path / "ckpt")
    rows = acceptance_table(model, [[3, 4, 5, 6], [7, 8]], [[10, 11, 12], [20, 21, 22, 23]], 6)
    assert [(r.target, r.drafter, r.kv_cache) for r in rows[:4]] == [
        ("none", "none", "none"),
        ("none", "fp8", "none"),
        ("none", "nvfp4", "none"),
        ("fp8", "none", "none"),
    ]
    assert len(rows) == 18
    for row in rows:
        assert 1.0 <= row.mean_acceptance_length <= model.draft.spec.block_size
        if (row.target, row.kv_cache) == ("none", "none"):
            assert row.same_output_as_unquantized == 1.0  # lossless: only the target decides the tokens
    assert "| nvfp4 | fp8 | fp8 |" in markdown(rows)
