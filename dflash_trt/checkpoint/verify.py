"""Re-read a converted checkpoint and prove it against its sources: config, every tensor of every rank.

Each stored tensor is recomputed from the HF / z-lab source with the converter's own layout and split rules and
compared bit for bit, so a truncated write, a wrong shard or a stale config cannot pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trt.checkpoint.convert import TORCH_DTYPES, check_sources, rank_file, rank_tensor
from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.checkpoint.layout import DRAFT, TARGET, checkpoint_layout
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile
from dflash_trt.checkpoint.sharding import pad_vocab_size
from dflash_trt.checkpoint.trtllm_config import checkpoint_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.spec import load_draft_spec, load_target_spec

QUANTIZATION_KEYS = ("quantization",)


@dataclass
class VerifyReport:
    checkpoint_dir: str
    tp_size: int = 0
    tensors_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        if self.ok:
            return f"OK: {self.checkpoint_dir} matches its sources ({self.tensors_checked} tensors, tp {self.tp_size})"
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"FAILED: {self.checkpoint_dir}: {self.problems[0]}{more}"

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checkpoint_dir": self.checkpoint_dir, "tp_size": self.tp_size,
                "tensors_checked": self.tensors_checked, "problems": self.problems}


def _strip_quantization(config: dict) -> dict:
    config = {k: v for k, v in config.items() if k != "quantization"}
    config["dflash_config"] = {k: v for k, v in config.get("dflash_config", {}).items() if k != "quantization"}
    return config


def verify_checkpoint(checkpoint_dir: str | Path, model_dir: str | Path, dflash_model_dir: str | Path) -> VerifyReport:
    checkpoint_dir = Path(checkpoint_dir)
    report = VerifyReport(str(checkpoint_dir))
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise DFlashTrtError(f"{checkpoint_dir} has no config.json")
    try:
        stored = json.loads(config_path.read_text())
        tp_size, dtype_name = stored["mapping"]["tp_size"], stored["dtype"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DFlashTrtError(f"{config_path} is not a dflash-trt checkpoint config: {exc}") from None
    if dtype_name not in TORCH_DTYPES or not isinstance(tp_size, int) or tp_size < 1:
        raise DFlashTrtError(f"{config_path} has an invalid dtype or tp_size")
    report.tp_size = tp_size
    target = load_target_spec(model_dir)
    draft = load_draft_spec(dflash_model_dir, target)
    expected = checkpoint_config(target, draft, dtype_name, tp_size,
                                 vocab_size_padded=pad_vocab_size(target.vocab_size, tp_size))
    for key in sorted(set(expected) | set(stored)):
        if _strip_quantization(expected).get(key) != _strip_quantization(stored).get(key):
            report.problems.append(f"config.json key '{key}' differs from what the sources give")
    dtype = TORCH_DTYPES[dtype_name]
    layout = checkpoint_layout(target, draft)
    with HFCheckpointReader(model_dir) as target_reader, HFCheckpointReader(dflash_model_dir) as draft_reader:
        check_sources(target, draft, target_reader, draft_reader)
        readers = {TARGET: target_reader, DRAFT: draft_reader}
        for rank in range(tp_size):
            path = checkpoint_dir / rank_file(rank)
            if not path.is_file():
                report.problems.append(f"{path.name} is missing")
                continue
            with SafetensorsFile(path) as written:
                extra = sorted(set(written.names()) - {out.name for out in layout})
                report.problems += [f"{path.name} has unexpected tensor '{name}'" for name in extra]
                for out in layout:
                    if out.name not in written:
                        report.problems.append(f"{path.name} is missing '{out.name}'")
                        continue
                    full = out.assemble([readers[model].get(name) for model, name in out.sources])
                    want = rank_tensor(out, full, dtype, tp_size, rank)
                    got = written.get(out.name)
                    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                        report.problems.append(f"{path.name} tensor '{out.name}' differs from its source")
                    report.tensors_checked += 1
    return report
