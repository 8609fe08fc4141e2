"""Where every constant of the performance model and the capacity planner comes from.

Each entry has a kind: `datasheet` (a vendor document or a format's definition, named), `measured` (a named file
or run), `assumed` (with the reason) or `fitted` (with the points it was fitted on). `dflash-trt plan
--provenance` prints this table; predictions carry the calibration they used.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.analysis import comm, evaluation, harness_fits, memory, model, rows
from dflash_trt.analysis.gpus import GPUS
from dflash_trt.analysis.published import FIT_ROWS, POINTS, TAU_SOURCES, TAUS, Unknown

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
        for field in ("hbm_bandwidth", "bf16_flops", "fp8_flops", "nvfp4_flops"):
            out[f"gpu.{key}.{field}"] = Constant(getattr(gpu, field), gpu.kind, gpu.source)
        out[f"gpu.{key}.interconnect"] = Constant(gpu.interconnect, gpu.kind, gpu.source)
    return out


def _comm_constants() -> dict[str, Constant]:
    out = {
        f"interconnect.{key}.link_bandwidth": Constant(link.link_bandwidth, link.kind, link.source)
        for key, link in comm.INTERCONNECTS.items()
    }
    sizes = ", ".join(f"{b} B" for b in comm.ONESHOT_SIZES_BYTES)
    for tp, us in comm.ONESHOT_US.items():
        out[f"allreduce.oneshot_us.tp{tp}"] = Constant(list(us), "measured", f"{comm.ONESHOT_SOURCE} (at {sizes})")
    latency, efficiency = comm.nccl_fit()
    out["allreduce.nccl_latency_s"] = Constant(latency, "measured", comm.NCCL_SOURCE)
    out["allreduce.nccl_bus_efficiency"] = Constant(efficiency, "measured", comm.NCCL_SOURCE)
    out["allreduce.algorithms"] = Constant(
        comm.ALGORITHMS,
        "datasheet",
        "TensorRT-LLM 1.2.x AllreducePlugin::selectImplementation (AUTO, read at 005b299b, not run): ONESHOT below "
        "the limit per TP width, NCCL above; the custom curve up to 8 MB for SGLang and vLLM",
    )
    out["allreduce.blackwell_latency"] = Constant(
        "the Hopper one-shot latencies, message sizes scaled by the link-bandwidth ratio",
        "assumed",
        "no Blackwell one-shot latency table is recorded; NCCL's symmetric-memory small all-reduce on Blackwell is "
        "reported at about 6-8 us (NCCL 2.27 blog figure as relayed in NVIDIA/nccl-tests issue #333), the range of "
        "Hopper's one-shot at TP 8",
    )
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
    }
    for harness in harness_fits.HARNESSES:
        cal = harness_fits.calibration(harness)
        kind = "assumed" if harness in harness_fits.TRANSFERRED else "fitted"
        for field in (*model.OVERHEAD_FIELDS, "error_band"):
            source = cal.band_source if field == "error_band" else cal.source
            out[f"calibration.{harness}.{field}"] = Constant(getattr(cal, field), kind, source)
    for harness, ids in FIT_ROWS.items():
        out[f"fit_rows.{harness}"] = Constant(list(ids), "fitted", "chosen before fitting (published.FIT_ROWS)")
    out["drift"] = Constant(
        harness_fits.drift(), "measured", "RMS relative error of SGLang's newer figures as predictions of the same "
        "sweep five weeks earlier (published.DRIFT_PAIRS)",
    )  # fmt: skip
    out["baseline.k"] = Constant(
        evaluation.baseline_k(), "fitted", "speedup = k * tau on the fit rows' single-user speedups"
    )
    out["eagle3.draft_vocab"] = Constant(
        rows.EAGLE3_DRAFT_VOCAB, "assumed", "reduced draft vocabulary of the EAGLE-3 speculators"
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
            "(draft positions + 1) + (drafts verified + 1): 2 x (draft tokens + 1) for a chain",
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
        | _comm_constants()
        | _format_constants()
        | _calibration_constants()
        | _capacity_constants()
        | _tau_constants()
        | _unknown_constants()
    )


def as_json() -> dict[str, dict]:
    return {name: vars(c) for name, c in constants().items()}
