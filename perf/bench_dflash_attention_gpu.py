"""DFlashAttention bandwidth: achieved bytes/s of the verify pass over the GPU's HBM peak (goal: at least 70 % at
batch 64, context 4k, K + 1 = 16), and the stock plugin's XQA figure on the same problem where both run (Hopper).

The verify pass is memory bound: per request and KV head it must read the whole past K and V once (all query heads
of the group and all 16 new tokens share each page), plus the new rows' qkv, the output, the new K / V it writes
and the rotated queries it stages. Those bytes over the measured time, against the datasheet HBM peak of the GPU
(`analysis/gpus.py`) and against a device copy of the same bytes measured here. On a GPU host it builds the kernels
as a torch extension; the stock figure needs TensorRT-LLM 1.2.x and SM90 (on SM100 / SM103 the stock plugin has no
spec-decoding kernel). Without CUDA it times the emulation's torch attention against a copy on the CPU, so
`make bench` still gets a measured ratio.

Last stdout line: the `perf/bench_all.py` JSON protocol.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from kernel_timing import best_cpu_seconds, cuda_seconds  # perf/kernel_timing.py

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
HEADS, KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK = 32, 8, 128, 32  # Qwen3-8B attention
THETA = 1_000_000.0


@dataclass(frozen=True)
class Case:
    label: str
    batch: int
    context: int
    queries: int  # K + 1 (verify) or B (draft block)
    cache: torch.dtype
    causal: bool = True
    window: int = 0
    tree: bool = False  # verify a draft tree of queries - 1 nodes (the runtime's packed mask and offsets)

    @property
    def block_mask(self) -> int:
        return 2 if self.tree else int(not self.causal)


CASES = [
    Case("verify_b64_ctx4k_k16_bf16", 64, 4096, 16, torch.bfloat16),
    Case("verify_b64_ctx4k_k16_fp8", 64, 4096, 16, torch.float8_e4m3fn),
    Case("verify_b8_ctx16k_k16_bf16", 8, 16384, 16, torch.bfloat16),
    Case("verify_tree32_b64_ctx4k_bf16", 64, 4096, 33, torch.bfloat16, tree=True),
    Case("draft_block_b64_ctx4k_b16_bf16", 64, 4096, 16, torch.bfloat16, causal=False),
    Case("draft_sliding_b64_ctx16k_w2k_bf16", 64, 16384, 16, torch.bfloat16, window=2048),
]


def bytes_moved(case: Case) -> int:
    """What the pass must move: past + new K / V read once per KV head (only the window's keys when windowed), the
    new rows' qkv read, the new K / V written, the rotated Q staged and read back, the output written."""
    keys = min(case.context, case.window) + case.queries if case.window else case.context + case.queries
    cache = torch.empty(0, dtype=case.cache).element_size()
    kv = case.batch * KV_HEADS * keys * HEAD_DIM * 2 * cache
    rows = case.batch * case.queries
    qkv = rows * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2
    new_kv = rows * 2 * KV_HEADS * HEAD_DIM * cache
    q_staged = 2 * rows * HEADS * HEAD_DIM * 2
    out = rows * HEADS * HEAD_DIM * 2
    return kv + qkv + new_kv + q_staged + out


def binary_tree(nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [nodes], packed mask rows [nodes, words]) of the tree whose node i hangs off node (i - 1) // 2: node i
    sees itself and its ancestors, bit j % 32 of word j // 32."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    depth, words = [0] * nodes, -(-nodes // 32)
    rows = torch.zeros(nodes, 32 * words, dtype=torch.int64)
    for i, parent in enumerate(parents):
        rows[i, i] = 1
        if parent >= 0:
            rows[i] |= rows[parent]
            depth[i] = depth[parent] + 1
    packed = (rows.view(nodes, words, 32) << torch.arange(32)).sum(-1)
    return torch.tensor(depth, dtype=torch.int32), torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def problem(case: Case, device: torch.device) -> dict:
    """Every request's pages on shuffled blocks of one single-layer pool; contexts of `case.context` tokens."""
    gen = torch.Generator().manual_seed(0)
    total = case.context + case.queries
    pages = -(-total // TOKENS_PER_BLOCK)
    physical = torch.randperm(case.batch * pages, generator=gen).view(case.batch, pages)
    raw = physical.long() * 2
    offsets = torch.stack([raw, raw + 1], dim=1).to(torch.int32)
    pool_shape = (case.batch * pages, 1, 2, KV_HEADS, TOKENS_PER_BLOCK, HEAD_DIM)
    pool = (torch.randn(pool_shape, device=device) * 0.5).to(case.cache)
    rows = case.batch * case.queries
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device).to(torch.bfloat16)
    angles = torch.arange(total + 1, dtype=torch.float32)[:, None] / THETA ** (
        torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM
    )
    cos_sin = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous().to(device)
    tree = (None, None)
    if case.tree:
        depth, mask = binary_tree(case.queries)
        tree = (depth.expand(case.batch, -1).contiguous().to(device), mask.repeat(case.batch, 1).to(device))
    return {
        "tree": tree,
        "qkv": qkv,
        "seq_lens": torch.full((case.batch,), total, dtype=torch.int32, device=device),
        "gen_lens": torch.full((case.batch,), case.queries, dtype=torch.int32, device=device),
        "cos_sin": cos_sin,
        "offsets": offsets.to(device),
        "pool": pool,
        "total": total,
    }


def time_cuda(fn) -> float:
    return cuda_seconds(fn, iters=20, warmup=3)


def hbm_peak() -> tuple[str | None, float | None]:
    from dflash_trt.analysis.gpus import GPUS
    from dflash_trt.gpu_targets import visible_gpu

    visible = visible_gpu()
    name = visible[0] if visible else None
    return name, (GPUS[name].hbm_bandwidth if name in GPUS else None)


def dflash_seconds(ext, case: Case, p: dict) -> float:
    cuda = torch.device("cuda")
    scales = [None, None]
    if case.cache == torch.float8_e4m3fn:
        scales = [torch.tensor([1.0], device=cuda), torch.tensor([1.0], device=cuda)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run() -> None:
        ext.attend(
            p["qkv"], p["seq_lens"], p["gen_lens"], p["cos_sin"], p["offsets"], TOKENS_PER_BLOCK, 0, HEADS,
            KV_HEADS, case.queries, case.window, False, case.block_mask, 1.0, p["pool"], None, *scales,
            p["total"], sms, *p["tree"],
        )  # fmt: skip

    return time_cuda(run)


def stock_seconds(case: Case, p: dict) -> float | None:
    """The stock GPT attention plugin (XQA, spec-decoding generation) on the same problem, or None where it cannot
    run: no TensorRT-LLM, a Blackwell GPU (no stock spec-decoding kernel), an FP8 / windowed / full-mask / tree case."""
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        return None
    major, _ = torch.cuda.get_device_capability(0)
    if major != 9 or case.cache != torch.bfloat16 or case.window or not case.causal or case.tree:
        return None
    from stock_attention import spec_decoding_session  # perf/stock_attention.py, GPU hosts only

    session, inputs, outputs = spec_decoding_session(
        p, case.batch, case.queries, HEADS, KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK, THETA
    )
    stream = torch.cuda.current_stream().cuda_stream
    return time_cuda(lambda: session.run(inputs=inputs, outputs=outputs, stream=stream))


def gpu() -> dict:
    from torch.utils.cpp_extension import load

    ext = load(
        name="dflash_attention_ext",
        sources=[str(PLUGINS / "tests" / "attentionTorchBinding.cpp"), str(PLUGINS / "src" / "attentionKernel.cu")],
        extra_include_paths=[str(PLUGINS / "include")],
        extra_cflags=["-O2", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17"],
    )
    name, peak = hbm_peak()
    results, ratios = {}, {}
    for case in CASES:
        p = problem(case, torch.device("cuda"))
        moved = bytes_moved(case)
        seconds = dflash_seconds(ext, case, p)
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_s = time_cuda(lambda dst=dst, src=src: dst.copy_(src))  # reads and writes moved / 2 each
        achieved = moved / seconds
        row = {"bytes": moved, "us": seconds * 1e6, "GBps": achieved / 1e9, "copy_GBps": moved / copy_s / 1e9}
        ratios[f"{case.label}_bytes_per_s_vs_copy"] = achieved * copy_s / moved
        if peak is not None:
            row["fraction_of_hbm_peak"] = achieved / peak
            ratios[f"{case.label}_bytes_per_s_vs_hbm_peak"] = achieved / peak
        stock = stock_seconds(case, p)
        if stock is not None:
            row["stock_GBps"] = moved / stock / 1e9
            ratios[f"{case.label}_stock_xqa_s_vs_dflash_s"] = stock / seconds
            if peak is not None:
                ratios[f"{case.label}_stock_xqa_bytes_per_s_vs_hbm_peak"] = moved / stock / peak
        results[case.label] = row
        share = f" = {achieved / peak:.0%} of {name}'s HBM peak ({peak / 1e12:.2f} TB/s)" if peak else ""
        print(f"{case.label}: {achieved / 1e9:.0f} GB/s{share}; copy {moved / copy_s / 1e9:.0f} GB/s", flush=True)
    return {
        "name": "dflash_attention_gpu",
        "ratios": ratios,
        "details": {"device": torch.cuda.get_device_name(), "gpu": name, "cases": results},
    }


def cpu() -> dict:
    """No CUDA: the emulation's float32 attention (what `dflash-trt emulate` runs) against a copy of its bytes."""
    case = Case("verify_b4_ctx512_k16_bf16", 4, 512, 16, torch.bfloat16)
    p = problem(case, torch.device("cpu"))
    keys = p["pool"][:, 0, 0].float().reshape(case.batch, -1, KV_HEADS, HEAD_DIM)[:, : p["total"]]
    values = p["pool"][:, 0, 1].float().reshape(case.batch, -1, KV_HEADS, HEAD_DIM)[:, : p["total"]]
    q = torch.randn(case.batch, HEADS, case.queries, HEAD_DIM)

    def attend() -> None:
        k = keys.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        v = values.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        torch.nn.functional.scaled_dot_product_attention(q, k, v)

    moved = bytes_moved(case)
    src = torch.empty(moved, dtype=torch.uint8)

    ref_s, copy_s = best_cpu_seconds(attend), best_cpu_seconds(src.clone)
    return {
        "name": "dflash_attention_gpu",
        "ratios": {"cpu_torch_attention_s_vs_copy_s": ref_s / copy_s},
        "details": {"device": "cpu (no CUDA: torch attention timed, kernels not run)", "bytes": moved},
    }


def main() -> None:
    print(json.dumps(gpu() if torch.cuda.is_available() else cpu()))


if __name__ == "__main__":
    main()
