"""Row-block streaming of large tensors writes exactly what whole-tensor conversion writes."""

from __future__ import annotations

import pytest
from _pairs import PairVariant, make_pair
from safetensors.torch import load_file, save_file

import dflash_trt.conversion.convert as convert
from dflash_trt.conversion import rank_writer
from dflash_trt.conversion.verify import verify_checkpoint
from dflash_trt.errors import DFlashTrtError


@pytest.fixture(scope="module")
def odd_vocab_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("stream"), PairVariant(vocab=93, heads=4, kv_heads=2))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_streamed_rank_files_equal_whole_tensor_conversion(odd_vocab_pair, tmp_path, monkeypatch, tp_size):
    convert.convert_checkpoint(*odd_vocab_pair, tmp_path / "whole", dtype="bfloat16", tp_size=tp_size)
    monkeypatch.setattr(rank_writer, "BLOCK_BYTES", 700)  # in blocks of a few rows, uneven at the end
    convert.convert_checkpoint(*odd_vocab_pair, tmp_path / "streamed", dtype="bfloat16", tp_size=tp_size)
    for rank in range(tp_size):
        name = f"rank{rank}.safetensors"
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert verify_checkpoint(tmp_path / "streamed", *odd_vocab_pair).ok


def test_nan_in_a_row_another_rank_owns_is_caught(odd_vocab_pair, tmp_path, edited_copy, monkeypatch):
    target_dir, draft_dir = odd_vocab_pair
    poisoned = edited_copy(target_dir, name="target")
    tensors = load_file(poisoned / "model.safetensors")
    tensors["lm_head.weight"][90, 3] = float("inf")  # a row of the last rank at tp 4
    save_file(tensors, poisoned / "model.safetensors")
    monkeypatch.setattr(rank_writer, "BLOCK_BYTES", 700)
    with pytest.raises(DFlashTrtError, match="target tensor 'lm_head.weight' contains NaN or Inf"):
        convert.convert_checkpoint(poisoned, draft_dir, tmp_path / "out", tp_size=4)
    assert not (tmp_path / "out").exists()


def test_row_reader_and_block_writer_agree_with_safetensors(tmp_path):
    import torch

    from dflash_trt.checkpoint.safetensors_io import SafetensorsFile, StreamingSafetensorsWriter

    tensors = {"a": torch.randn(37, 5).to(torch.bfloat16), "b": torch.arange(10, dtype=torch.int8)}
    save_file(tensors, tmp_path / "x.safetensors")
    with SafetensorsFile(tmp_path / "x.safetensors") as reader:
        assert torch.equal(torch.from_numpy(reader.read_rows("a", 3, 20)).view(torch.bfloat16), tensors["a"][3:20])
        assert reader.read_rows("a", 5, 5).shape == (0, 5)
        with pytest.raises(DFlashTrtError, match="outside tensor"):
            reader.read_rows("a", 30, 40)
        entries = {"a": (torch.bfloat16, (37, 5)), "b": (torch.int8, (10,))}
        with StreamingSafetensorsWriter(tmp_path / "y.safetensors", entries) as writer:
            writer.start("a")
            for i in range(0, 37, 8):
                writer.append(reader.read_rows("a", i, min(i + 8, 37)))
            writer.finish()
            writer.write("b", reader.get("b"))
        short = StreamingSafetensorsWriter(tmp_path / "z.safetensors", entries)
        short.start("a")
        short.append(reader.read_rows("a", 0, 8))
        with pytest.raises(DFlashTrtError, match="finished 290 bytes short"):
            short.finish()
        assert not (tmp_path / "z.safetensors").exists()
    written = load_file(tmp_path / "y.safetensors")
    assert all(torch.equal(written[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("tp_size", [1, 4])
def test_every_source_byte_is_read_once(odd_vocab_pair, tmp_path, monkeypatch, tp_size):
    """One pass: however the ranks split a tensor (rows, columns, q|k|v per head group, KV heads shared by two ranks),
    each byte of every source is read once, in blocks (no whole-tensor read, no read per rank)."""
    from dflash_trt.checkpoint.safetensors_io import SafetensorsFile

    files = [*odd_vocab_pair[0].glob("*.safetensors"), *odd_vocab_pair[1].glob("*.safetensors")]
    sizes = {(path.parent.name, name): t.nbytes for path in files for name, t in load_file(path).items()}
    read = dict.fromkeys(sizes, 0)
    original = SafetensorsFile.read_rows

    def counting(self, name, start, stop, into=None):
        rows = original(self, name, start, stop, into)
        read[self.path.parent.name, name] += rows.nbytes
        return rows

    monkeypatch.setattr(SafetensorsFile, "read_rows", counting)
    monkeypatch.setattr(rank_writer, "BLOCK_BYTES", 700)
    convert.convert_checkpoint(*odd_vocab_pair, tmp_path / "out", dtype="bfloat16", tp_size=tp_size)
    assert read == sizes


@pytest.mark.parametrize(
    "variant",
    [{}, {"kind": "dflash", "draft_vocab_size": 33}],
    ids=["dflash2-3d-convolution-kernels", "draft-vocabulary-int64-map"],
)
def test_speculators_drafter_extras_stream_like_whole_reads(tmp_path, monkeypatch, variant):
    """A DFlash2 drafter's 3-D convolution kernels (one 3-D source each, not a stack of experts) and a reduced
    vocabulary's int64 id map (stored as int32) stream in blocks of a few rows to the same bytes, which verify."""
    from _speculators_pairs import SpeculatorsVariant, make_speculators_pair

    pair = make_speculators_pair(tmp_path / "pair", SpeculatorsVariant(**variant))
    convert.convert_checkpoint(*pair, tmp_path / "whole", dtype="bfloat16", tp_size=2)
    monkeypatch.setattr(rank_writer, "BLOCK_BYTES", 700)
    convert.convert_checkpoint(*pair, tmp_path / "streamed", dtype="bfloat16", tp_size=2)
    for rank in range(2):
        name = f"rank{rank}.safetensors"
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert verify_checkpoint(tmp_path / "streamed", *pair).ok
