/*
 * Torch extension around launchDflashAttention for the GPU tests and the bandwidth benchmark: the kernels the
 * TensorRT plugin enqueues, driven with torch CUDA tensors on the current stream.
 */
#include "dflash_trt/attentionKernel.h"

#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

namespace
{

void checkDeviceInt32(torch::Tensor const& t, char const* name)
{
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == torch::kInt32, name, " must be contiguous CUDA int32");
}

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

//! qkv [tokens, (heads + 2 kv_heads) * head_dim]; block_offsets [requests, 2, max_blocks] (this pool, the
//! generation requests' rows); the pools [blocks, layers_in_pool, 2, kv_heads, tokens_per_block, head_dim].
//! blockMask 0 causal / 1 full / 2 tree (then positionOffsets [requests, >= n] and packedMask [tokens, words],
//! int32 CUDA, the runtime's spec-decoding inputs). Returns the output [tokens, heads * head_dim]; the pools
//! receive the new tokens' K / V.
torch::Tensor attend(torch::Tensor qkv, torch::Tensor seqLens, torch::Tensor genLens, torch::Tensor cosSin,
    torch::Tensor blockOffsets, int64_t tokensPerBlock, int64_t layerInPool, int64_t numHeads, int64_t numKvHeads,
    int64_t maxQueryLen, int64_t window, bool windowFromBlock, int64_t blockMask, double qScaling,
    torch::Tensor primaryPool, c10::optional<torch::Tensor> secondaryPool, c10::optional<torch::Tensor> scaleOrigQuant,
    c10::optional<torch::Tensor> scaleQuantOrig, int64_t maxKeys, int64_t multiProcessorCount,
    c10::optional<torch::Tensor> positionOffsets, c10::optional<torch::Tensor> packedMask)
{
    TORCH_CHECK(blockMask >= 0 && blockMask <= 2, "block_mask must be 0 (causal), 1 (full) or 2 (tree)");
    TORCH_CHECK((blockMask == 2) == (positionOffsets.has_value() && packedMask.has_value()),
        "a tree mask takes position offsets and a packed mask, and only it does");
    if (blockMask == 2)
    {
        checkDeviceInt32(*positionOffsets, "position_offsets");
        checkDeviceInt32(*packedMask, "packed_mask");
        TORCH_CHECK(positionOffsets->dim() == 2 && packedMask->dim() == 2, "position offsets and packed mask are 2-D");
    }
    TORCH_CHECK(qkv.is_cuda() && qkv.is_contiguous() && qkv.dim() == 2, "qkv must be a contiguous CUDA [tokens, width]");
    TORCH_CHECK(qkv.scalar_type() == torch::kHalf || qkv.scalar_type() == torch::kBFloat16, "qkv must be fp16 / bf16");
    checkDeviceInt32(seqLens, "sequence_length");
    checkDeviceInt32(genLens, "generation_lengths");
    checkDeviceInt32(blockOffsets, "block_offsets");
    TORCH_CHECK(cosSin.is_cuda() && cosSin.is_contiguous() && cosSin.scalar_type() == torch::kFloat32,
        "rotary_cos_sin must be contiguous CUDA float32");
    TORCH_CHECK(blockOffsets.dim() == 3 && blockOffsets.size(1) == 2, "block_offsets must be [requests, 2, max_blocks]");
    int64_t const headDim = qkv.size(1) / (numHeads + 2 * numKvHeads);
    auto out = torch::empty({qkv.size(0), numHeads * headDim}, qkv.options());
    int32_t const inputBytes = static_cast<int32_t>(qkv.element_size());
    auto workspace = torch::empty(
        {dflash_trt::attentionWorkspaceBound(qkv.size(0), static_cast<int32_t>(numHeads), static_cast<int32_t>(headDim),
            inputBytes)},
        qkv.options().dtype(torch::kUInt8));

    dflash_trt::AttentionLaunch p{};
    p.qkv = qkv.data_ptr();
    p.out = out.data_ptr();
    p.seqLens = seqLens.data_ptr<int32_t>();
    p.genLens = genLens.data_ptr<int32_t>();
    p.cosSin = cosSin.data_ptr<float>();
    p.addressing = dflash_trt::PagedKVAddressing{blockOffsets.data_ptr<int32_t>(), static_cast<int32_t>(blockOffsets.size(0)),
        static_cast<int32_t>(blockOffsets.size(2)), dflash_trt::log2PowerOfTwo(static_cast<int32_t>(tokensPerBlock)),
        static_cast<int32_t>(numKvHeads), static_cast<int32_t>(headDim), static_cast<int32_t>(layerInPool)};
    p.primaryPool = primaryPool.data_ptr();
    p.secondaryPool = secondaryPool ? secondaryPool->data_ptr() : nullptr;
    p.scaleOrigQuant = scaleOrigQuant ? scaleOrigQuant->data_ptr<float>() : nullptr;
    p.scaleQuantOrig = scaleQuantOrig ? scaleQuantOrig->data_ptr<float>() : nullptr;
    p.workspace = workspace.data_ptr();
    p.numRequests = static_cast<int32_t>(seqLens.size(0));
    p.numTokens = static_cast<int32_t>(qkv.size(0));
    p.numHeads = static_cast<int32_t>(numHeads);
    p.maxQueryLen = static_cast<int32_t>(maxQueryLen);
    p.maxPositions = static_cast<int32_t>(cosSin.numel() / headDim);
    p.window = dflash_trt::KeyWindow{static_cast<int32_t>(window),
        windowFromBlock ? dflash_trt::WindowAnchor::kBlock : dflash_trt::WindowAnchor::kQuery};
    p.mask = static_cast<dflash_trt::BlockMask>(blockMask);
    if (blockMask == 2)
    {
        p.tree = dflash_trt::TreeMask{positionOffsets->data_ptr<int32_t>(), static_cast<int32_t>(positionOffsets->size(1)),
            packedMask->data_ptr<int32_t>(), static_cast<int32_t>(packedMask->size(1))};
    }
    p.qScaling = static_cast<float>(qScaling);
    auto const input = qkv.scalar_type() == torch::kHalf ? dflash_trt::InputType::kHALF : dflash_trt::InputType::kBF16;
    cudaError_t const status = dflash_trt::launchDflashAttention(p, input, cacheTypeOf(primaryPool),
        static_cast<int32_t>(maxKeys), static_cast<int32_t>(multiProcessorCount), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(status == cudaSuccess, "launchDflashAttention: ", cudaGetErrorString(status));
    return out;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("attend", &attend, "DFlashAttention (prepare, attend, combine) on torch CUDA tensors");
}
