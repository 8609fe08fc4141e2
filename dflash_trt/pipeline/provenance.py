"""Where every constant of the performance model and the capacity planner comes from.

Each entry has a kind: `datasheet` (a vendor document or a format's definition, named), `measured` (a named file
or run), `assumed` (with the reason) or `fitted` (with the points it was fitted on). `dflash-trt plan
--provenance` prints this table; predictions carry the calibration they used.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.analysis import evaluation, memory, model
from dflash_trt.analysis.gpus import GPUS
from dflash_trt.analysis.published import POINTS, TAU_SOURCES, TAUS, Unknown

KINDS = ("datasheet", "measured", "assumed", "fitted")


@dataclass(frozen=True)
class Constant:
    value: object
    kind: str
    source: str


def _gpu_constants() -> dict[str, Constant]:
    out = {}
    for key, gpu in GPUS.items():
        out[f"gpu.{key}.hbm_bytes"] = Constant(gpu.hbm_bytes, gpu.memory_kind, gpu.memory_source or gpu.source)
        for field in ("hbm_bandwidth", "bf16_flops", "fp8_flops", "nvfp4_flops", "nvlink_bandwidth"):
            out[f"gpu.{key}.{field}"] = Constant(getattr(gpu, field), gpu.kind, gpu.source)
    return out


def _format_constants() -> dict[str, Constant]:
    formats = {
        "bf16": "2 bytes per value",
        "fp8": "FP8 E4M3, 1 byte per value (per-tensor scales are negligible)",
        "nvfp4": "NVFP4 format: 4-bit E2M1 values plus one E4M3 scale per 16 values",
        "mxfp4": "OCP MX FP4 format: 4-bit E2M1 values plus one E8M0 scale per 32 values",
    }
    out = {f"weight_bytes.{k}": Constant(v, "datasheet", formats[k]) for k, v in model.WEIGHT_BYTES.items()}
    out |= {f"kv_bytes.{k}": Constant(v, "datasheet", formats[k]) for k, v in model.KV_BYTES.items()}
    out["lm_head_bytes"] = Constant(
        model.LM_HEAD_BYTES, "assumed", "the lm_head and embeddings stay bf16 (modelopt's default exclusions)"
    )
    out["activation_bytes"] = Constant(model.ACTIVATION_BYTES, "assumed", "all-reduce payloads and taps in bf16")
    return out


def _calibration_constants() -> dict[str, Constant]:
    default = model.Calibration()
    why = (
        "typical fraction reached by large kernels, the same for every harness; not fitted by any code, but they "
        "were set together with the first comparison table, so that they were not tuned to it cannot be shown"
    )
    out = {
        "calibration.bandwidth_efficiency": Constant(default.bandwidth_efficiency, "assumed", why),
        "calibration.compute_efficiency": Constant(default.compute_efficiency, "assumed", why),
        "calibration.allreduce_latency_s": Constant(default.allreduce_latency_s, "assumed", "typical NCCL latency"),
    }
    for harness in evaluation.HARNESSES:
        kind = "assumed" if harness in evaluation.TRANSFERRED else "fitted"
        for cal in evaluation.calibrations(harness):
            reading = cal.name.split("(")[-1].rstrip(")")
            for field in ("step_overhead_s", "spec_overhead_s", "token_overhead_s"):
                out[f"calibration.{harness}.{reading}.{field}"] = Constant(getattr(cal, field), kind, cal.source)
    fits = ", ".join(sorted(evaluation.fit_set_ids()))
    out["baseline.k"] = Constant(evaluation.baseline_k(), "fitted", f"speedup = k * tau on the fit set ({fits})")
    out["eagle3.draft_vocab"] = Constant(
        evaluation.EAGLE3_DRAFT_VOCAB, "assumed", "reduced draft vocabulary of the EAGLE-3 speculators"
    )
    return out


def _capacity_constants() -> dict[str, Constant]:
    return {
        "capacity.tokens_per_block": Constant(
            memory.TOKENS_PER_BLOCK,
            "datasheet",
            "trtllm-build plugin-config default (TensorRT-LLM 1.2.x sources, not run)",
        ),
        "capacity.step_headroom_tokens": Constant(
            "2 x (draft tokens + 1)",
            "datasheet",
            "TensorRT-LLM 1.2.x cpp/tensorrt_llm/batch_manager/allocateKvCache.cpp: EAGLE-mode engines add "
            "maxPathLen + maxDecodingTokens tokens per step; kvCacheManager.cpp getRemainingBlocksToCompletion "
            "reserves promptLen + maxNewTokens (read, not run)",
        ),
        "capacity.weight_layout": Constant(
            "linears / tp; embedding and drafter fc replicated; lm_head always written, split by vocabulary rows",
            "measured",
            "this converter's tensor layout (checkpoint/layout.py: vocab_embedding and dflash.fc replicated, "
            "lm_head Split.VOCAB, written from embed_tokens when tied)",
        ),
        "capacity.default_limits": Constant(
            vars(memory.EngineLimits()),
            "datasheet",
            "TensorRT-LLM BuildConfig defaults (max_batch_size 2048, max_num_tokens 8192) and the executor's 0.9 KV "
            "fraction (1.2.x sources, read, not run); plan defaults max_batch_size to the largest --concurrency",
        ),
        "capacity.runtime_reserve_bytes": Constant(
            memory.RUNTIME_RESERVE_BYTES, "assumed", "CUDA context, cuBLAS/NCCL workspaces and runtime buffers"
        ),
        "capacity.logits_bytes": Constant(
            memory.LOGITS_BYTES, "assumed", "fp32 logits for every verified token of a full batch"
        ),
        "capacity.activation_model": Constant(
            "max_num_tokens x (2 hidden + qkv/tp + 2 intermediate/tp) x 2 B + logits",
            "assumed",
            "one layer's live bf16 tensors per token (TensorRT reuses activation memory across layers)",
        ),
    }


def _unknown_constants() -> dict[str, Constant]:
    out = {}
    for p in POINTS:
        for field, value in vars(p).items():
            if isinstance(value, Unknown):
                out[f"published.{p.id}.{field}"] = Constant(list(value.values), value.kind, value.why)
    return out


def _tau_constants() -> dict[str, Constant]:
    out = {}
    for pair, taus in TAUS.items():
        for (dataset, temperature), tau in taus.items():
            temp = "unstated" if temperature is None else f"{temperature:g}"
            out[f"tau.{pair}.{dataset}.t{temp}"] = Constant(tau, "datasheet", TAU_SOURCES[pair])
    return out


def constants() -> dict[str, Constant]:
    return (
        _gpu_constants()
        | _format_constants()
        | _calibration_constants()
        | _capacity_constants()
        | _tau_constants()
        | _unknown_constants()
    )


def as_json() -> dict[str, dict]:
    return {name: vars(c) for name, c in constants().items()}
