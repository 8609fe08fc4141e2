"""KV-injection bandwidth: the CUDA kernel against a device copy of the same number of bytes.

The kernel is memory bound: per token it reads `layers * 2 * kv_heads * head_dim` input values and writes as many
cache values (plus a few int32 per token and the k_norm weights). On a GPU host it builds the kernel as a torch
extension and reports achieved GB/s for decode- and prefill-sized batches (bf16 and FP8 caches) next to
`Tensor.copy_` moving the same bytes. Without CUDA it times the torch reference (what the golden model runs)
against the same copy baseline on the CPU, so `make bench` still gets a measured ratio.

Last stdout line: the `perf/bench_all.py` JSON protocol.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kernel_timing import best_cpu_seconds, cuda_seconds  # perf/kernel_timing.py

from dflash_trt.reference.kv_injection import PagedKVCacheLayout, kv_injection
from dflash_trt.rope import RopeConfig, inv_freq_and_scale

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
HEADS, HEAD_DIM, LAYERS, TOKENS_PER_BLOCK = 8, 128, 5, 32  # Qwen3-8B-sized drafter KV geometry


def _problem(batch: int, per_seq: int, cache_dtype: torch.dtype, device: torch.device, layers: int = LAYERS):
    """`batch` sequences each appending `per_seq` consecutive tokens from position 1000 on; only the touched pages
    get (shuffled) physical blocks, the others point at block 0, which is never written."""
    gen = torch.Generator().manual_seed(0)
    start, tpb = 1000, TOKENS_PER_BLOCK
    first_page, pages = start // tpb, (start + per_seq + tpb - 1) // tpb
    touched = pages - first_page
    layers_in_pool = layers + 1
    table = torch.zeros(batch, pages, dtype=torch.int64)
    table[:, first_page:] = 1 + torch.randperm(batch * touched, generator=gen).view(batch, touched)
    raw = table * layers_in_pool * 2
    offsets = torch.stack([raw, raw + 1], dim=1).to(torch.int32)
    positions = (start + torch.arange(per_seq)).repeat(batch).to(torch.int32)
    seq_slots = torch.arange(batch).repeat_interleave(per_seq).to(torch.int32)
    tokens = batch * per_seq
    ctx_kv = torch.randn(tokens, layers, 2, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    weight = torch.ones(layers, HEAD_DIM, dtype=torch.bfloat16)
    layout = PagedKVCacheLayout(HEADS, HEAD_DIM, tpb, pages, layer_idx_in_pool=1)
    pool_shape = (1 + batch * touched, layers_in_pool, 2, HEADS, tpb, HEAD_DIM)
    pool = torch.zeros(pool_shape, dtype=torch.float16, device=device).to(cache_dtype)
    tensors = [ctx_kv, weight, positions, seq_slots, torch.ones(tokens, dtype=torch.int32), offsets]
    return layout, [t.to(device) for t in tensors] + [pool]


def _bytes_moved(tokens: int, layers: int, cache_dtype: torch.dtype) -> int:
    values = tokens * layers * 2 * HEADS * HEAD_DIM
    cache_size = torch.empty(0, dtype=cache_dtype).element_size()
    return values * (2 + cache_size) + layers * HEAD_DIM * 2 + tokens * 3 * 4


def _gpu() -> dict:
    from torch.utils.cpp_extension import load

    ext = load(
        name="dflash_kv_injection_ext",
        sources=[str(PLUGINS / "tests" / "kvInjectionTorchBinding.cpp"), str(PLUGINS / "src" / "kvInjectionKernel.cu")],
        extra_include_paths=[str(PLUGINS / "include")],
        extra_cflags=["-O2", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17"],
    )
    rope = RopeConfig(HEAD_DIM, 1_000_000.0)
    inv_freq, scaling = inv_freq_and_scale(rope)
    cuda = torch.device("cuda")
    results, ratios = {}, {}
    for label, batch, per_seq, cache_dtype in [
        ("decode_b64x16_bf16", 64, 16, torch.bfloat16),
        ("decode_b256x16_bf16", 256, 16, torch.bfloat16),
        ("prefill_8192_bf16", 1, 8192, torch.bfloat16),
        ("decode_b256x16_fp8", 256, 16, torch.float8_e4m3fn),
    ]:
        layout, (ctx_kv, weight, positions, seq_slots, valid, offsets, pool) = _problem(
            batch, per_seq, cache_dtype, cuda
        )
        scale = torch.tensor([1.0], device=cuda) if cache_dtype == torch.float8_e4m3fn else None

        def run(
            ctx_kv=ctx_kv,
            weight=weight,
            positions=positions,
            seq_slots=seq_slots,
            valid=valid,
            offsets=offsets,
            pool=pool,
            scale=scale,
        ) -> None:
            ext.inject(
                ctx_kv,
                weight,
                positions,
                positions,
                seq_slots,
                valid,
                offsets,
                TOKENS_PER_BLOCK,
                1,
                pool,
                None,
                scale,
                1e-6,
                inv_freq,
                scaling,
            )

        moved = _bytes_moved(batch * per_seq, LAYERS, cache_dtype)
        src = torch.empty(moved // 2, dtype=torch.uint8, device=cuda)
        dst = torch.empty_like(src)
        kernel_s = _time_cuda(run)
        copy_s = _time_cuda(lambda dst=dst, src=src: dst.copy_(src))
        results[label] = {
            "tokens": batch * per_seq,
            "bytes": moved,
            "kernel_us": kernel_s * 1e6,
            "kernel_GBps": moved / kernel_s / 1e9,
            "copy_GBps": moved / copy_s / 1e9,
        }
        ratios[f"{label}_kernel_s_vs_copy_s"] = kernel_s / copy_s
    return {
        "name": "kv_injection_gpu",
        "ratios": ratios,
        "details": {"device": torch.cuda.get_device_name(), "cases": results},
    }


def _time_cuda(fn) -> float:
    return cuda_seconds(fn, iters=50, warmup=5)


def _cpu() -> dict:
    cpu = torch.device("cpu")
    layers = 2
    layout, (ctx_kv, weight, positions, seq_slots, valid, offsets, pool) = _problem(16, 16, torch.bfloat16, cpu, layers)
    rope = RopeConfig(HEAD_DIM, 1_000_000.0)
    moved = _bytes_moved(len(positions), layers, torch.bfloat16)
    src = torch.empty(moved // 2, dtype=torch.uint8)

    ref_s = best_cpu_seconds(
        lambda: kv_injection(ctx_kv, weight, 1e-6, positions, seq_slots, valid, rope, layout, offsets, pool)
    )
    copy_s = best_cpu_seconds(lambda: src.clone())
    return {
        "name": "kv_injection_gpu",
        "ratios": {"cpu_reference_s_vs_copy_s": ref_s / copy_s},
        "details": {
            "device": "cpu (no CUDA: torch reference timed, kernel not run)",
            "tokens": len(positions),
            "bytes": moved,
            "reference_ms": ref_s * 1e3,
            "copy_ms": copy_s * 1e3,
        },
    }


def main() -> None:
    result = _gpu() if torch.cuda.is_available() else _cpu()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
