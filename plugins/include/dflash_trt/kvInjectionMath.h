/*
 * Index, address, RoPE, RMS-norm and quantization math of the DFlash KV-injection kernel.
 *
 * Every function here is __host__ __device__ so the exact code the GPU runs is also compiled for the CPU and tested
 * against the torch definition (dflash_trt/reference/kv_injection.py). Nothing here touches TensorRT.
 */
#pragma once

#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#if defined(__CUDACC__)
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash_trt
{

//! Bit 31 of a block index selects the secondary (offload) pool, as TensorRT-LLM's KVCacheIndex encodes it.
constexpr uint32_t kSecondaryPoolFlag = 0x80000000u;
//! Largest finite float8 e4m3 value; quantization saturates there (no NaN from overflow).
constexpr float kFp8E4m3Max = 448.0f;
//! Head dims the kernel vectorises (16-byte chunks in each rotate-half half).
constexpr int32_t kMaxHeadDim = 256;

enum class CacheType : int32_t
{
    kHALF = 0,
    kBF16 = 1,
    kFP8_E4M3 = 2,
};

//! One KV pool of TensorRT-LLM 1.2.x as the GPT attention plugin addresses it (kvCacheUtils.h, KVBlockArray):
//! blockOffsets is that pool's [numSeqs][2 (K, V)][maxBlocksPerSeq] int32 table; a block holds
//! [numKvHeads][tokensPerBlock][headDim] elements of one layer; layer j of the pool sits 2*j blocks further.
struct PagedKVAddressing
{
    int32_t const* blockOffsets;
    int32_t numSeqs;
    int32_t maxBlocksPerSeq;
    int32_t tokensPerBlockLog2;
    int32_t numKvHeads;
    int32_t headDim;
    int32_t firstLayerInPool;
};

//! Where one element of the cache lives; valid is false for addresses the table cannot resolve.
struct CacheLocation
{
    bool valid;
    bool secondary;
    int64_t element;
};

DFLASH_HD CacheLocation locateCacheElement(
    PagedKVAddressing const& a, int32_t seq, int32_t position, int32_t layer, int32_t kv, int32_t head, int32_t channel)
{
    CacheLocation loc{false, false, 0};
    int32_t const page = position >> a.tokensPerBlockLog2;
    if (seq < 0 || seq >= a.numSeqs || position < 0 || page >= a.maxBlocksPerSeq)
    {
        return loc;
    }
    uint32_t const raw = static_cast<uint32_t>(a.blockOffsets[(static_cast<int64_t>(seq) * 2 + kv) * a.maxBlocksPerSeq + page]);
    int64_t const index = static_cast<int64_t>(raw & ~kSecondaryPoolFlag);
    int64_t const tokensPerBlock = int64_t{1} << a.tokensPerBlockLog2;
    int64_t const blockElements = static_cast<int64_t>(a.numKvHeads) * tokensPerBlock * a.headDim;
    int64_t const row = position & (tokensPerBlock - 1);
    loc.valid = true;
    loc.secondary = (raw & kSecondaryPoolFlag) != 0;
    loc.element = (index + 2 * static_cast<int64_t>(a.firstLayerInPool + layer)) * blockElements
        + (head * tokensPerBlock + row) * a.headDim + channel;
    return loc;
}

//! Offset of element (token, layer, kv, head, channel) in ctx_kv [tokens][layers][2][numKvHeads][headDim].
DFLASH_HD int64_t ctxKvOffset(
    int32_t token, int32_t layer, int32_t kv, int32_t head, int32_t channel, int32_t numLayers, int32_t numKvHeads,
    int32_t headDim)
{
    return ((((static_cast<int64_t>(token) * numLayers + layer) * 2 + kv) * numKvHeads + head) * headDim) + channel;
}

//! RoPE factors of frequency i at a position: angle in float32 as HF does, cos/sin times yarn's attention scaling.
DFLASH_HD void ropeCosSin(int32_t position, float invFreq, float attentionScaling, float& c, float& s)
{
    float const angle = static_cast<float>(position) * invFreq;
    c = cosf(angle) * attentionScaling;
    s = sinf(angle) * attentionScaling;
}

//! 1 / sqrt(mean(x^2) + eps) from the sum of squares of one head.
DFLASH_HD float inverseRms(float sumSquares, int32_t headDim, float eps)
{
    return 1.0f / sqrtf(sumSquares / static_cast<float>(headDim) + eps);
}

//! k_norm then rotate-half RoPE of the pair (x[i], x[i + headDim/2]) sharing frequency i.
DFLASH_HD void normRopePair(
    float x0, float x1, float invRms, float w0, float w1, float c, float s, float& out0, float& out1)
{
    float const y0 = x0 * invRms * w0;
    float const y1 = x1 * invRms * w1;
    out0 = y0 * c - y1 * s;
    out1 = y1 * c + y0 * s;
}

DFLASH_HD float toFloat(__half x)
{
    return __half2float(x);
}

DFLASH_HD float toFloat(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

DFLASH_HD float toFloat(__nv_fp8_e4m3 x)
{
    return static_cast<float>(x);
}

//! Round a float32 result into the cache type once; FP8 multiplies by the orig->quant scale and saturates.
template <typename Cache>
DFLASH_HD Cache toCache(float x, float scaleOrigQuant);

template <>
DFLASH_HD __half toCache<__half>(float x, float)
{
    return __float2half_rn(x);
}

template <>
DFLASH_HD __nv_bfloat16 toCache<__nv_bfloat16>(float x, float)
{
    return __float2bfloat16_rn(x);
}

template <>
DFLASH_HD __nv_fp8_e4m3 toCache<__nv_fp8_e4m3>(float x, float scaleOrigQuant)
{
    __nv_fp8_e4m3 out;
    out.__x = __nv_cvt_float_to_fp8(x * scaleOrigQuant, __NV_SATFINITE, __NV_E4M3);
    return out;
}

//! Elements one thread handles in each rotate-half half: one 16-byte vector of fp16/bf16 input.
constexpr int32_t kElementsPerLane = 8;

//! Threads that share one head (each owns kElementsPerLane elements of both halves), or 0 for an unsupported
//! head dim: it must be a multiple of 16, at most kMaxHeadDim, with a power-of-two lane count so a head's lanes
//! never straddle a warp.
DFLASH_HD int32_t lanesPerHead(int32_t headDim)
{
    if (headDim <= 0 || headDim > kMaxHeadDim || headDim % (2 * kElementsPerLane) != 0)
    {
        return 0;
    }
    int32_t const lanes = headDim / (2 * kElementsPerLane);
    return (lanes & (lanes - 1)) == 0 ? lanes : 0;
}

//! log2 of a power of two, or -1.
DFLASH_HD int32_t log2PowerOfTwo(int32_t x)
{
    if (x <= 0 || (x & (x - 1)) != 0)
    {
        return -1;
    }
    int32_t n = 0;
    while ((1 << n) < x)
    {
        ++n;
    }
    return n;
}

} // namespace dflash_trt
