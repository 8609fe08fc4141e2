"""Conversion to the TensorRT-LLM checkpoint layout, checked tensor by tensor against the HF sources."""

from __future__ import annotations

import json

import pytest
import torch
from _pairs import PairVariant, make_pair
from safetensors.torch import load_file

from dflash_trt import tensor_names as names
from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError


@pytest.fixture(scope="module")
def biased_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("convert"), PairVariant(target_bias=True, draft_bias=True))


def test_layout_names_and_values(biased_pair, tmp_path):
    target_dir, draft_dir = biased_pair
    convert_checkpoint(target_dir, draft_dir, tmp_path / "ckpt", dtype="float32")
    out = load_file(tmp_path / "ckpt" / "rank0.safetensors")
    hf = load_file(target_dir / "model.safetensors")
    zl = load_file(draft_dir / "model.safetensors")
    layer = names.target_layer(2)
    fused = torch.cat([hf[f"model.layers.2.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(out[names.tensor(layer, names.QKV)], fused)
    fused_bias = torch.cat([hf[f"model.layers.2.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(out[names.tensor(layer, names.QKV, names.BIAS)], fused_bias)
    assert torch.equal(out[names.tensor(layer, names.MLP_FC)], hf["model.layers.2.mlp.gate_proj.weight"])
    assert torch.equal(out[names.tensor(layer, names.MLP_GATE)], hf["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(out[names.tensor(layer, names.MLP_PROJ)], hf["model.layers.2.mlp.down_proj.weight"])
    assert torch.equal(out[names.tensor(layer, names.Q_LAYERNORM)], hf["model.layers.2.self_attn.q_norm.weight"])
    assert torch.equal(out[names.VOCAB_EMBEDDING], hf["model.embed_tokens.weight"])
    assert torch.equal(out[names.LM_HEAD], hf["lm_head.weight"])
    assert torch.equal(out[names.DRAFT_FC], zl["fc.weight"])
    assert torch.equal(out[names.DRAFT_FINAL_NORM], zl["norm.weight"])
    dlayer = names.draft_layer(1)
    assert torch.equal(out[names.tensor(dlayer, names.DENSE)], zl["layers.1.self_attn.o_proj.weight"])
    assert torch.equal(out[names.tensor(dlayer, names.K_LAYERNORM)], zl["layers.1.self_attn.k_norm.weight"])
    assert all(name.startswith(("transformer.", "lm_head.", "dflash.")) for name in out)


def test_config_json(biased_pair, tmp_path):
    target_dir, draft_dir = biased_pair
    convert_checkpoint(target_dir, draft_dir, tmp_path / "ckpt", dtype="bfloat16")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["architecture"] == "DFlashForCausalLM" and cfg["base_architecture"] == "Qwen3ForCausalLM"
    assert cfg["dtype"] == "bfloat16" and cfg["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert cfg["max_draft_len"] == 7 and cfg["dflash_config"]["block_size"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["dflash_config"]["mask_token_id"] == 95
    assert cfg["qk_layernorm"] is True and cfg["head_size"] == 16 and cfg["num_key_value_heads"] == 2
    tensors = load_file(tmp_path / "ckpt" / "rank0.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_tied_embeddings_feed_lm_head(tmp_path):
    target_dir, draft_dir = make_pair(tmp_path, PairVariant(arch="llama", tie=True))
    convert_checkpoint(target_dir, draft_dir, tmp_path / "ckpt", dtype="float32")
    out = load_file(tmp_path / "ckpt" / "rank0.safetensors")
    assert torch.equal(out[names.LM_HEAD], out[names.VOCAB_EMBEDDING])
    assert names.tensor(names.target_layer(0), names.Q_LAYERNORM) not in out


def test_existing_output_is_kept_without_overwrite(biased_pair, tmp_path):
    target_dir, draft_dir = biased_pair
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DFlashTrtError, match="already exists; pass --overwrite"):
        convert_checkpoint(target_dir, draft_dir, out)
    assert (out / "keep.txt").read_text() == "mine"
    # --overwrite replaces only what an earlier convert wrote: a folder of the user's files is never deleted.
    with pytest.raises(DFlashTrtError, match="holds files dflash-trt did not write"):
        convert_checkpoint(target_dir, draft_dir, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (out / "keep.txt").unlink()
    convert_checkpoint(target_dir, draft_dir, out)  # an empty folder is filled
    (out / "stray.txt").write_text("left by a user in our output")
    convert_checkpoint(target_dir, draft_dir, out, overwrite=True)
    assert not (out / "stray.txt").exists() and (out / "rank0.safetensors").is_file()
    assert not list(tmp_path.glob(".ckpt.partial-*"))


def _corrupt(edited_copy, biased_pair, edit):
    target_dir, draft_dir = biased_pair
    bad = edited_copy(draft_dir, name="bad_draft")
    edit(bad)
    return target_dir, bad


def test_nan_weight_refused_and_nothing_written(biased_pair, tmp_path, edited_copy):
    from safetensors.torch import save_file

    def poison(d):
        tensors = load_file(d / "model.safetensors")
        tensors["layers.0.mlp.up_proj.weight"][3, 4] = float("nan")
        save_file(tensors, d / "model.safetensors")

    target_dir, bad = _corrupt(edited_copy, biased_pair, poison)
    with pytest.raises(DFlashTrtError, match="drafter tensor 'layers.0.mlp.up_proj.weight' contains NaN or Inf"):
        convert_checkpoint(target_dir, bad, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("layers.1.self_attn.q_norm.weight"),
            "drafter checkpoint is missing tensor 'layers.1.self_attn.q_norm.weight'",
        ),
        (
            lambda t: t.update({"layers.9.mlp.up_proj.weight": torch.zeros(2)}),
            "drafter checkpoint has unexpected tensor 'layers.9.mlp.up_proj.weight'",
        ),
        (
            lambda t: t.update({"fc.weight": torch.zeros(64, 64)}),
            r"drafter tensor 'fc.weight' has shape \(64, 64\), expected \(64, 128\)",
        ),
    ],
)
def test_tensor_set_mismatches_are_refused(biased_pair, tmp_path, edited_copy, edit, message):
    from safetensors.torch import save_file

    def apply(d):
        tensors = load_file(d / "model.safetensors")
        edit(tensors)
        save_file(tensors, d / "model.safetensors")

    target_dir, bad = _corrupt(edited_copy, biased_pair, apply)
    with pytest.raises(DFlashTrtError, match=message):
        convert_checkpoint(target_dir, bad, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_cli_errors_are_one_line_and_exit_2(biased_pair, tmp_path, capsys):
    target_dir, draft_dir = biased_pair
    code = main(
        [
            "convert",
            "--model_dir",
            str(draft_dir),
            "--dflash_model_dir",
            str(draft_dir),
            "--output_dir",
            str(tmp_path / "x"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "target architecture 'DFlashDraftModel' is not supported" in err
    argv = ["convert", "--model_dir", str(target_dir), "--dflash_model_dir", str(draft_dir), "--output_dir"]
    with pytest.raises(SystemExit) as exited:  # refused while the arguments are parsed
        main([*argv, str(tmp_path / "x"), "--pp_size", "2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "argument --pp_size: must be an integer in [1, 1]" in err


def test_verify_passes_then_catches_tampering(biased_pair, tmp_path, capsys):
    from safetensors.torch import save_file

    target_dir, draft_dir = biased_pair
    ckpt = tmp_path / "ckpt"
    assert (
        main(
            [
                "convert",
                "--model_dir",
                str(target_dir),
                "--dflash_model_dir",
                str(draft_dir),
                "--output_dir",
                str(ckpt),
                "--dtype",
                "float16",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["tensors_per_rank"] > 0
    assert verify_checkpoint(ckpt, target_dir, draft_dir).ok
    tensors = load_file(ckpt / "rank0.safetensors")
    tensors[names.DRAFT_HIDDEN_NORM][0] += 1
    (ckpt / "rank0.safetensors").unlink()
    save_file(tensors, ckpt / "rank0.safetensors")
    code = main(
        ["verify", "--checkpoint_dir", str(ckpt), "--model_dir", str(target_dir), "--dflash_model_dir", str(draft_dir)]
    )
    assert code == 1 and "dflash.hidden_norm.weight' differs from its source" in capsys.readouterr().out
