"""`verify --calib_dataset`: calibrated scales are recomputed from the prompts and compared bit for bit, so a
checkpoint calibrated on other prompts fails where a range check would pass."""

from __future__ import annotations

import json

import pytest

from dflash_trt.cli import main
from dflash_trt.commands.demo import write_calibration_prompts
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.tiny.heldout import draft_dir, target_dir


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_calib")
    prompts = write_calibration_prompts(root / "calib.jsonl", count=4)
    checkpoint = root / "ckpt"
    convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype="float32", qformat="fp8", kv_cache_dtype="fp8",
                       calib_dataset=prompts, calib_size=4, calib_max_seq_len=64)  # fmt: skip
    return checkpoint, prompts


def _verify(checkpoint, capsys, *extra):
    argv = ["verify", "--checkpoint_dir", str(checkpoint), "--model_dir", str(target_dir()),
            "--dflash_model_dir", str(draft_dir()), "--json", *extra]  # fmt: skip
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_scales_are_recomputed_from_the_calibration_prompts(fp8_checkpoint, capsys):
    checkpoint, prompts = fp8_checkpoint
    code, plain = _verify(checkpoint, capsys)
    assert code == 0 and plain["scales_range_checked"] > 0 and plain["scales_recalibrated"] == 0
    calib = ["--calib_dataset", str(prompts), "--calib_size", "4", "--calib_max_seq_len", "64"]
    code, report = _verify(checkpoint, capsys, *calib)
    assert code == 0 and report["problems"] == []
    assert report["scales_recalibrated"] == plain["scales_range_checked"] and report["scales_range_checked"] == 0


def test_other_calibration_prompts_fail_the_check(fp8_checkpoint, tmp_path, capsys):
    checkpoint, prompts = fp8_checkpoint
    other = tmp_path / "other.jsonl"
    lines = prompts.read_text().splitlines()
    other.write_text("\n".join(reversed(lines[:4])) + "\n" + json.dumps({"text": "mul 9999 9999\n" * 3}) + "\n")
    code, report = _verify(checkpoint, capsys, "--calib_dataset", str(other), "--calib_size", "5",
                           "--calib_max_seq_len", "64")  # fmt: skip
    assert code == 1
    assert any("differs from the scale calibration on the given prompts yields" in p for p in report["problems"])


def test_a_missing_calibration_file_is_one_clear_error(fp8_checkpoint, tmp_path, capsys):
    checkpoint, _ = fp8_checkpoint
    argv = ["verify", "--checkpoint_dir", str(checkpoint), "--model_dir", str(target_dir()),
            "--dflash_model_dir", str(draft_dir()), "--calib_dataset", str(tmp_path / "absent.jsonl")]  # fmt: skip
    assert main(argv) == 2
    assert "--calib_dataset" in capsys.readouterr().err
