"""The shipped calibration prompt set, `--calib_dataset` as a jsonl file or an HF datasets folder, and the
profiles' check that the set exists."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

from dflash_trt.errors import DFlashTrtError
from dflash_trt.pipeline.profiles import load_profile
from dflash_trt.prompts import read_prompts
from dflash_trt.quant.calibration_prompts import CATEGORIES, calibration_prompts

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "build_configs" / "calibration.jsonl"
PROFILES = sorted((ROOT / "build_configs").glob("*/*.yaml"))


class CharTokenizer:
    """One id per character: enough to count prompt lengths without a model's tokenizer."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _rows() -> list[dict]:
    return [json.loads(line) for line in SHIPPED.read_text(encoding="utf-8").splitlines()]


def test_shipped_file_is_the_generated_set():
    assert _rows() == calibration_prompts()  # regenerate with: python -m dflash_trt.quant.calibration_prompts


def test_shipped_set_is_large_diverse_and_mixed_early():
    rows = _rows()
    texts = [r["text"] for r in rows]
    assert len(rows) >= 512 and len(set(texts)) == len(texts)
    by_category = {c: [r["text"] for r in rows if r["category"] == c] for c in CATEGORIES}
    assert set(by_category) == {"math", "code", "chat", "multilingual", "short", "long"}
    assert all(len(v) >= 80 for v in by_category.values())
    # Any prefix a smaller --calib_size takes still mixes every category.
    assert {r["category"] for r in rows[:12]} == set(CATEGORIES)
    assert max(map(len, by_category["short"])) < 80 and min(map(len, by_category["long"])) > 800
    scripts = {
        unicodedata.name(ch).split()[0] for text in by_category["multilingual"] for ch in text if ord(ch) > 0x24F
    }
    assert {"CJK", "HIRAGANA", "CYRILLIC", "ARABIC", "DEVANAGARI"} <= scripts
    assert len(read_prompts(SHIPPED, CharTokenizer())) == len(rows)


def test_every_profile_names_the_one_shipped_set():
    for path in PROFILES:
        assert load_profile(path).calibration_dataset(path).resolve() == SHIPPED, path


def test_profiles_refuse_a_missing_calibration_set(tmp_path: Path):
    data = yaml.safe_load(PROFILES[0].read_text())
    data["quantization"]["calibration"]["dataset"] = "prompts/mine.jsonl"
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(data))
    with pytest.raises(DFlashTrtError, match=r"quantization.calibration.dataset: .*prompts/mine.jsonl does not exist"):
        load_profile(profile)
    data["quantization"].update(qformat="none", dflash_qformat="none", kv_cache_dtype="none")
    data["engine"].update(gemm_plugin="auto", use_fp8_context_fmha=False)
    profile.write_text(yaml.safe_dump(data))
    assert load_profile(profile).calibration_dataset(profile) is None  # nothing to calibrate, nothing required


@pytest.mark.slow  # importing datasets takes seconds
def test_calib_dataset_may_be_a_saved_hf_datasets_folder(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    texts = ["first prompt", "second prompt", "third"]
    datasets.Dataset.from_dict({"text": texts, "source": ["a", "b", "c"]}).save_to_disk(str(tmp_path / "plain"))
    assert read_prompts(tmp_path / "plain", CharTokenizer(), limit=2) == [CharTokenizer().encode(t) for t in texts[:2]]
    split = datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"input_ids": [[5, 6]]}),
            "train": datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}),
        }
    )
    split.save_to_disk(str(tmp_path / "splits"))
    assert read_prompts(tmp_path / "splits") == [[1, 2, 3], [4]]  # the train split
    datasets.Dataset.from_dict({"article": ["x"]}).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(DFlashTrtError, match=r"has no text or input_ids column \(columns: article\)"):
        read_prompts(tmp_path / "other", CharTokenizer())


def test_a_folder_without_the_datasets_package_is_one_clear_error(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as on a host without the package
    with pytest.raises(DFlashTrtError, match="needs the `datasets` package, else give a jsonl file"):
        read_prompts(tmp_path, CharTokenizer())
