/*
 * Torch extension around launchKvInjection for the GPU tests and the bandwidth benchmark: the same kernel the
 * TensorRT plugin enqueues, driven with torch CUDA tensors. Runs on the legacy default stream, which torch uses
 * unless told otherwise, so no extra synchronisation is needed around it.
 */
#include "dflash_trt/kvInjectionKernel.h"

#include <torch/extension.h>

#include <cstring>

namespace
{

dflash_trt::CacheType cacheTypeOf(torch::Tensor const& pool)
{
    if (pool.scalar_type() == torch::kHalf)
    {
        return dflash_trt::CacheType::kHALF;
    }
    if (pool.scalar_type() == torch::kBFloat16)
    {
        return dflash_trt::CacheType::kBF16;
    }
    TORCH_CHECK(pool.scalar_type() == torch::kFloat8_e4m3fn, "KV pool must be float16, bfloat16 or float8_e4m3fn");
    return dflash_trt::CacheType::kFP8_E4M3;
}

void checkDeviceInt32(torch::Tensor const& t, char const* name)
{
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == torch::kInt32, name, " must be contiguous CUDA int32");
}

void inject(torch::Tensor ctxKv, torch::Tensor kNormWeight, torch::Tensor positions, torch::Tensor cachePositions,
    torch::Tensor seqSlots, torch::Tensor valid, torch::Tensor blockOffsets, int64_t tokensPerBlock, int64_t firstLayerInPool,
    torch::Tensor primaryPool, c10::optional<torch::Tensor> secondaryPool, c10::optional<torch::Tensor> scaleOrigQuant,
    double eps, torch::Tensor invFreq, double attentionScaling)
{
    TORCH_CHECK(ctxKv.is_cuda() && ctxKv.is_contiguous() && ctxKv.dim() == 5 && ctxKv.size(2) == 2,
        "ctx_kv must be a contiguous CUDA tensor [tokens, layers, 2, kv_heads, head_dim]");
    TORCH_CHECK(ctxKv.scalar_type() == torch::kHalf || ctxKv.scalar_type() == torch::kBFloat16,
        "ctx_kv must be float16 or bfloat16");
    TORCH_CHECK(kNormWeight.is_cuda() && kNormWeight.is_contiguous() && kNormWeight.scalar_type() == ctxKv.scalar_type()
            && kNormWeight.size(0) == ctxKv.size(1) && kNormWeight.size(1) == ctxKv.size(4),
        "k_norm_weight must be [layers, head_dim] on the GPU in ctx_kv's dtype");
    checkDeviceInt32(positions, "positions");
    checkDeviceInt32(cachePositions, "cache_positions");
    checkDeviceInt32(seqSlots, "seq_slots");
    checkDeviceInt32(valid, "valid");
    checkDeviceInt32(blockOffsets, "block_offsets");
    TORCH_CHECK(blockOffsets.dim() == 3 && blockOffsets.size(1) == 2, "block_offsets must be [seqs, 2, max_blocks]");
    TORCH_CHECK(primaryPool.is_cuda() && primaryPool.is_contiguous(), "the KV pool must be a contiguous CUDA tensor");
    TORCH_CHECK(invFreq.device().is_cpu() && invFreq.scalar_type() == torch::kFloat32
            && invFreq.numel() == ctxKv.size(4) / 2 && ctxKv.size(4) <= dflash_trt::kMaxHeadDim,
        "inv_freq must be a CPU float32 tensor of head_dim / 2 values");

    dflash_trt::KVInjectionParams p{};
    p.ctxKv = ctxKv.data_ptr();
    p.kNormWeight = kNormWeight.data_ptr();
    p.positions = positions.data_ptr<int32_t>();
    p.cachePositions = cachePositions.data_ptr<int32_t>();
    p.seqSlots = seqSlots.data_ptr<int32_t>();
    p.valid = valid.data_ptr<int32_t>();
    p.numTokens = static_cast<int32_t>(ctxKv.size(0));
    p.numLayers = static_cast<int32_t>(ctxKv.size(1));
    p.addressing = dflash_trt::PagedKVAddressing{blockOffsets.data_ptr<int32_t>(),
        static_cast<int32_t>(blockOffsets.size(0)), static_cast<int32_t>(blockOffsets.size(2)),
        dflash_trt::log2PowerOfTwo(static_cast<int32_t>(tokensPerBlock)), static_cast<int32_t>(ctxKv.size(3)),
        static_cast<int32_t>(ctxKv.size(4)), static_cast<int32_t>(firstLayerInPool)};
    p.primaryPool = primaryPool.data_ptr();
    p.secondaryPool = nullptr;
    if (secondaryPool.has_value())
    {
        TORCH_CHECK(secondaryPool->is_cuda() && secondaryPool->is_contiguous()
                && secondaryPool->scalar_type() == primaryPool.scalar_type(),
            "the secondary pool must match the primary one");
        p.secondaryPool = secondaryPool->data_ptr();
    }
    p.scaleOrigQuant = nullptr;
    if (scaleOrigQuant.has_value())
    {
        TORCH_CHECK(scaleOrigQuant->is_cuda() && scaleOrigQuant->scalar_type() == torch::kFloat32,
            "scale_orig_quant must be a CUDA float32 tensor");
        p.scaleOrigQuant = scaleOrigQuant->data_ptr<float>();
    }
    p.eps = static_cast<float>(eps);
    p.attentionScaling = static_cast<float>(attentionScaling);
    std::memcpy(p.invFreq, invFreq.data_ptr<float>(), invFreq.numel() * sizeof(float));

    auto const input
        = ctxKv.scalar_type() == torch::kHalf ? dflash_trt::InputType::kHALF : dflash_trt::InputType::kBF16;
    cudaError_t const status = dflash_trt::launchKvInjection(p, input, cacheTypeOf(primaryPool), nullptr);
    TORCH_CHECK(status == cudaSuccess, "launchKvInjection: ", cudaGetErrorString(status));
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("inject", &inject, "DFlash KV injection into a paged pool (CUDA)");
}
