"""Re-read a converted checkpoint and prove it against its sources: config, every tensor of every rank.

Each stored tensor is recomputed from the HF / z-lab source with the converter's own layout and split rules and
compared bit for bit, so a truncated write, a wrong shard or a stale config cannot pass. Calibrated activation and
KV-cache scales depend on the calibration prompts: given them (`--calib_dataset`, with the conversion's
`--calib_size` and `--calib_max_seq_len`), calibration is rerun and every scale it yields compared bit for bit;
without them the scales are only checked to be finite and positive.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dflash_trt import tensor_names as names
from dflash_trt.checkpoint.hf_reader import HFCheckpointReader, open_drafter
from dflash_trt.checkpoint.layout import DRAFT, TARGET
from dflash_trt.checkpoint.safetensors_io import SafetensorsFile, tensor_has_nonfinite
from dflash_trt.checkpoint.sharding import pad_vocab_size
from dflash_trt.checkpoint.stored import QuantSettings
from dflash_trt.checkpoint.trtllm_config import checkpoint_config
from dflash_trt.conversion.convert import check_sources
from dflash_trt.conversion.plan import ConversionPlan, rank_file, rank_tensors
from dflash_trt.conversion.prequantized import read_hf_quant_config
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import DTYPES
from dflash_trt.jsonfile import read_json_object
from dflash_trt.spec import load_draft_spec, load_target_spec


@dataclass
class VerifyReport:
    checkpoint_dir: str
    tp_size: int = 0
    tensors_checked: int = 0
    scales_range_checked: int = 0  # calibrated scales: only finite and positive, their values are not re-derived
    scales_recalibrated: int = 0  # calibrated scales recomputed from the calibration prompts, bit for bit
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        if self.ok:
            unchecked = (
                f"; {self.scales_range_checked} calibrated activation/KV scales were only checked to be "
                "finite and positive, not re-derived (that needs the calibration prompts: --calib_dataset)"
                if self.scales_range_checked
                else ""
            )
            if self.scales_recalibrated:
                unchecked = f"; {self.scales_recalibrated} calibrated scales recomputed from the prompts" + unchecked
            return (
                f"OK: {self.checkpoint_dir} matches its sources ({self.tensors_checked} tensors recomputed bit for "
                f"bit, tp {self.tp_size}){unchecked}"
            )
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"FAILED: {self.checkpoint_dir}: {self.problems[0]}{more}"

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "checkpoint_dir": self.checkpoint_dir,
            "tp_size": self.tp_size,
            "tensors_checked": self.tensors_checked,
            "scales_range_checked": self.scales_range_checked,
            "scales_recalibrated": self.scales_recalibrated,
            "problems": self.problems,
        }


@dataclass(frozen=True)
class Calibration:
    """The calibration run a quantized checkpoint was converted with (convert's --calib_* flags)."""

    dataset: Path
    size: int = 64
    max_seq_len: int = 512


def verify_checkpoint(
    checkpoint_dir: str | Path,
    model_dir: str | Path,
    dflash_model_dir: str | Path,
    calibration: Calibration | None = None,
) -> VerifyReport:
    checkpoint_dir = Path(checkpoint_dir)
    report = VerifyReport(str(checkpoint_dir))
    stored, tp_size, dtype_name, moe_ep_size = _stored_config(checkpoint_dir)
    report.tp_size = tp_size
    target = load_target_spec(model_dir)
    draft = load_draft_spec(dflash_model_dir, target)
    quant = QuantSettings.from_config(stored)
    expected = checkpoint_config(
        target,
        draft,
        dtype_name,
        tp_size,
        quant.config(draft=False),
        quant.config(draft=True),
        vocab_size_padded=pad_vocab_size(target.vocab_size, tp_size),
        moe_ep_size=moe_ep_size,
    )
    for key in sorted(set(expected) | set(stored)):
        if expected.get(key) != stored.get(key):
            report.problems.append(f"config.json key '{key}' differs from what the sources give")
    prequantized = read_hf_quant_config(model_dir)
    plan = ConversionPlan(
        Path(model_dir),
        Path(dflash_model_dir),
        target,
        draft,
        dtype_name,
        tp_size,
        quant,
        prequantized=prequantized,
        moe_ep_size=moe_ep_size,
    )
    entries = plan.entries() if not quant.enabled else None
    recalibrated: dict[str, torch.Tensor] = {}
    if calibration is not None and quant.enabled:
        from dflash_trt.conversion.convert import calibrated_scales

        recalibrated = calibrated_scales(
            Path(model_dir),
            Path(dflash_model_dir),
            checkpoint_dir.resolve().parent,
            dtype_name,
            quant,
            calibration.dataset,
            calibration.size,
            calibration.max_seq_len,
        )
    with HFCheckpointReader(model_dir) as target_reader, open_drafter(dflash_model_dir) as draft_reader:
        check_sources(target, draft, target_reader, draft_reader, prequantized)
        readers = {TARGET: target_reader, DRAFT: draft_reader}
        for rank in range(tp_size):
            path = checkpoint_dir / rank_file(rank)
            if not path.is_file():
                report.problems.append(f"{path.name} is missing")
                continue
            with SafetensorsFile(path) as written:
                _check_rank_file(report, written, path.name, plan, entries, recalibrated, readers, rank)
    return report


def _stored_config(checkpoint_dir: Path) -> tuple[dict, int, str, int]:
    """The written config.json and the layout fields every rank file is checked against."""
    config_path = checkpoint_dir / "config.json"
    stored = read_json_object(config_path, f"{checkpoint_dir} has no config.json")
    try:
        tp_size, dtype_name = stored["mapping"]["tp_size"], stored["dtype"]
    except (KeyError, TypeError) as exc:
        raise DFlashTrtError(f"{config_path} is not a dflash-trt checkpoint config: {exc}") from None
    moe_ep_size = stored["mapping"].get("moe_ep_size", 1)
    if dtype_name not in DTYPES or not isinstance(tp_size, int) or tp_size < 1:
        raise DFlashTrtError(f"{config_path} has an invalid dtype or tp_size")
    if not isinstance(moe_ep_size, int) or moe_ep_size < 1 or tp_size % moe_ep_size:
        raise DFlashTrtError(f"{config_path} has an invalid moe_ep_size")
    return stored, tp_size, dtype_name, moe_ep_size


def _check_rank_file(
    report: VerifyReport,
    written: SafetensorsFile,
    file_name: str,
    plan: ConversionPlan,
    entries: dict | None,
    recalibrated: dict[str, torch.Tensor],
    readers: dict,
    rank: int,
) -> None:
    """One rank file against the tensors recomputed from the sources."""
    # Calibrated scales cannot be recomputed without the calibration data: take them from the file,
    # check they are usable, and recompute everything else (weights, weight scales) from the sources.
    scales = {name: written.get(name, copy=True) for name in written.names() if _is_calibrated(name)}
    report.problems += [
        f"{file_name} tensor '{n}' is not a finite positive scale"
        for n, t in scales.items()
        if not bool(torch.isfinite(t).all() and (t > 0).all())
    ]
    report.problems += [
        f"{file_name} tensor '{n}' differs from the scale calibration on the given prompts yields "
        "(other prompts, --calib_size or --calib_max_seq_len than the conversion's?)"
        for n, t in scales.items()
        if n in recalibrated and not torch.equal(t, recalibrated[n])
    ]
    report.scales_recalibrated += sum(n in recalibrated for n in scales)
    report.scales_range_checked += sum(n not in recalibrated for n in scales)
    rank_plan = replace(plan, scales=scales)
    expected = entries if entries is not None else rank_plan.entries()
    extra = sorted(set(written.names()) - set(expected))
    report.problems += [f"{file_name} has unexpected tensor {name!r}" for name in extra]
    for out in plan.layout:
        if any(name not in written for name in _names_of(rank_plan, out)):
            report.problems.append(f"{file_name} is missing a tensor of '{out.name}'")
            continue
        for name, want in rank_tensors(rank_plan, out, readers, rank, check_finite=False).items():
            if _is_calibrated(name):
                continue  # taken from the file itself above: comparing it with itself proves nothing
            got = written.get(name)
            if tensor_has_nonfinite(got):
                report.problems.append(f"{file_name} tensor '{name}' holds NaN or Inf")
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                report.problems.append(f"{file_name} tensor '{name}' differs from its source")
            report.tensors_checked += 1


def _is_calibrated(name: str) -> bool:
    return name.endswith((f".{names.ACTIVATION_SCALING_FACTOR}", f".{names.KV_CACHE_SCALING_FACTOR}"))


def _names_of(plan: ConversionPlan, out) -> list[str]:
    return list(plan.entries_of(out))
