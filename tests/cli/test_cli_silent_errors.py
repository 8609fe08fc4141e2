"""Results that used to be silently wrong: overflow in the cast, calibrated scales nobody re-derived, and the like.

Each test builds the damaged input from the embedded tiny pair and checks the project now says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _hostile_cli import World, hub_snapshot, make_world, run_cli
from safetensors.torch import load_file, save_file

from dflash_trt.checkpoint.atomic import OUTPUT_MARKER
from dflash_trt.conversion import rank_writer
from dflash_trt.conversion.calibrate import calibrate_pair
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline import fingerprints
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tokenizer import load_tokenizer

FP16_MAX = torch.finfo(torch.float16).max


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return make_world(tmp_path_factory.mktemp("silent"))


def _edit_weights(model_dir: Path, name: str, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, path, metadata={"format": "pt"})


def _copy_models(world: World, root: Path) -> tuple[Path, Path]:
    return shutil.copytree(world.target, root / "target"), shutil.copytree(world.draft, root / "draft")


@pytest.mark.parametrize("name", ["model.layers.2.mlp.down_proj.weight", "model.embed_tokens.weight"])
def test_float16_overflow_after_the_cast_is_refused(world: World, tmp_path: Path, name: str) -> None:
    target, draft = _copy_models(world, tmp_path)

    def too_big(t: torch.Tensor) -> torch.Tensor:
        t[-1, -1] = 2.0 * FP16_MAX  # finite in float32, +Inf in float16
        return t

    _edit_weights(target, name, too_big)
    with pytest.raises(DFlashTrtError, match=f"target tensor '{name}' does not fit float16.*--dtype bfloat16"):
        convert_checkpoint(target, draft, tmp_path / "ckpt", dtype="float16", tp_size=2)
    assert not (tmp_path / "ckpt").exists()
    convert_checkpoint(target, draft, tmp_path / "ckpt", dtype="bfloat16")  # bfloat16 holds it
    assert verify_checkpoint(tmp_path / "ckpt", target, draft).ok


def test_verify_finds_infinities_an_overflowing_cast_wrote(world: World, tmp_path: Path, monkeypatch) -> None:
    """A checkpoint from before the check (simulated by disabling it) holds +Inf: verify must not call it OK."""
    target, draft = _copy_models(world, tmp_path)
    _edit_weights(target, "model.norm.weight", lambda t: t.fill_(1e5))
    monkeypatch.setattr(rank_writer, "bits_have_nonfinite", lambda *args: False)
    convert_checkpoint(target, draft, tmp_path / "ckpt", dtype="float16")
    monkeypatch.undo()
    report = verify_checkpoint(tmp_path / "ckpt", target, draft)
    assert not report.ok
    assert "tensor 'transformer.ln_f.weight' holds NaN or Inf" in report.verdict()


def _scale_names(path: Path) -> list[str]:
    return [n for n in load_file(path) if n.endswith(("activation_scaling_factor", "kv_cache_scaling_factor"))]


@pytest.mark.slow
def test_verify_says_how_many_calibrated_scales_it_only_range_checked(world: World, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    convert_checkpoint(
        world.target,
        world.draft,
        out,
        dtype="float32",
        qformat="fp8",
        kv_cache_dtype="fp8",
        calib_dataset=world.prompts,
        calib_size=2,
        calib_max_seq_len=8,
    )
    rank0 = out / "rank0.safetensors"
    scales = _scale_names(rank0)
    assert scales
    tensors = load_file(rank0)
    tensors[scales[0]] = tensors[scales[0]] * 1000  # tampered, yet finite and positive
    save_file(tensors, rank0, metadata={"format": "pt"})
    report = verify_checkpoint(out, world.target, world.draft)
    assert report.scales_range_checked == len(scales)
    assert f"{len(scales)} calibrated activation/KV scales were only checked to be finite and positive" in (
        report.verdict()
    )
    assert report.to_dict()["scales_range_checked"] == len(scales)


def test_an_unquantized_checkpoint_has_no_unchecked_scales(world: World) -> None:
    report = verify_checkpoint(world.checkpoint, world.target, world.draft)
    assert report.ok and report.scales_range_checked == 0 and "only checked" not in report.verdict()


def test_hub_cache_links_are_followed_and_their_files_copied(world: World, tmp_path: Path) -> None:
    target = hub_snapshot(world.target, tmp_path / "hub")
    draft = hub_snapshot(world.draft, tmp_path / "hub", "models--org--tiny-dflash")
    out = tmp_path / "ckpt"
    convert_checkpoint(target, draft, out, dtype="float32")
    ours = ("rank", "config", "dflash_", OUTPUT_MARKER)
    copied = sorted(p.name for p in out.iterdir() if not p.name.startswith(ours))
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in copied:
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (world.target / name).read_bytes()
    tokenizer = load_tokenizer(out)
    assert tokenizer is not None and tokenizer.encode("add 1 2") == load_tokenizer(world.target).encode("add 1 2")


def test_a_link_out_of_the_model_folder_is_refused(world: World, tmp_path: Path) -> None:
    target, draft = _copy_models(world, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    (target / "tokenizer.json").unlink()
    (target / "tokenizer.json").symlink_to(secret)
    with pytest.raises(DFlashTrtError, match="tokenizer.json links to .*secret.txt, outside the model folder"):
        convert_checkpoint(target, draft, tmp_path / "ckpt", dtype="float32")
    assert not (tmp_path / "ckpt").exists()


def test_a_corrupt_tokenizer_is_one_clear_error(world: World, tmp_path: Path) -> None:
    folder = shutil.copytree(world.target, tmp_path / "t")
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    with pytest.raises(DFlashTrtError, match="the tokenizer in .* cannot be loaded"):
        load_tokenizer(folder)


def test_tokenizer_code_in_auto_map_is_never_run(world: World, tmp_path: Path) -> None:
    folder = shutil.copytree(world.target, tmp_path / "t")
    marker = tmp_path / "code-ran"
    (folder / "tokenization_evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    auto_map = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    config.update(tokenizer_class="EvilTokenizer", auto_map=auto_map)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    try:
        load_tokenizer(folder)
    except DFlashTrtError as exc:
        assert "cannot be loaded" in str(exc)
    assert not marker.exists()


def _rewrite_in_place(path: Path) -> None:
    """Change one byte in the middle of a file, keeping its size (what an in-place re-export does)."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x40]))


def test_stage_fingerprints_see_large_files_rewritten_in_place(world: World, tmp_path: Path) -> None:
    target = shutil.copytree(world.target, tmp_path / "target")
    weights = target / "model.safetensors"
    assert weights.stat().st_size > fingerprints.CONTENT_HASH_LIMIT
    before = fingerprints.directory_fingerprint(target)
    _rewrite_in_place(weights)
    assert fingerprints.directory_fingerprint(target) != before


def test_hub_blobs_are_known_by_their_content_name(world: World, tmp_path: Path) -> None:
    """Two downloads of the same snapshot (other times, other hosts) fingerprint alike, so a copied workspace
    resumes on the GPU host without converting again."""
    first = hub_snapshot(world.target, tmp_path / "a")
    second = hub_snapshot(world.target, tmp_path / "b")
    for blob in (tmp_path / "b").rglob("blobs/*"):
        os.utime(blob, ns=(1, 1))
    assert fingerprints.directory_fingerprint(first) == fingerprints.directory_fingerprint(second)


def test_build_config_redoes_a_checkpoint_whose_source_was_rewritten(world: World, tmp_path: Path, capsys) -> None:
    target = shutil.copytree(world.target, tmp_path / "target")
    profile = tmp_path / "tiny.yaml"
    profile.write_text(world.profile.read_text().replace(str(world.target), str(target)))
    argv = ["build", "--config", str(profile), "--output_dir", str(tmp_path / "ws")]
    run_cli(argv, capsys)
    _, out, _ = run_cli(argv, capsys)
    assert "checkpoint -> " in out and "complete, skipped" in out
    _rewrite_in_place(target / "model.safetensors")
    _, out, _ = run_cli(argv, capsys)
    assert "[1/3] checkpoint" in out and ": stale, running" in out


def test_progress_reports_every_generated_token_and_calibrated_prompt(world: World) -> None:
    model = load_golden_model(world.checkpoint)
    counts: list[int] = []
    results = speculative_generate(model, [[5, 6, 7], [8, 9]], 12, [], progress=counts.append)
    assert sum(counts) == sum(len(r.output_ids) for r in results) == 24 and len(counts) > 2
    prompts: list[int] = []
    calibrate_pair(model, [[5, 6, 7], [8, 9], [10]], 4, "fp8", "fp8", progress=prompts.append)
    assert sum(prompts) == 2 * 3  # the target pass, then the drafter pass over the quantized target


def test_a_calibrating_convert_removes_scratch_left_by_a_killed_run(world: World, tmp_path: Path) -> None:
    """What a SIGKILL during calibration leaves (a whole unquantized checkpoint) is gone after the next run."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".dflash-calibration-{int(dead.stdout)}-abc123" / "checkpoint"
    shutil.copytree(world.checkpoint, stale)
    convert_checkpoint(
        world.target,
        world.draft,
        tmp_path / "fp8",
        dtype="float32",
        qformat="fp8",
        calib_dataset=world.prompts,
        calib_size=1,
        calib_max_seq_len=4,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]
