/*
 * DFlash KV injection: one launch for all draft layers and tokens.
 *
 * Work unit = (token, layer, K|V, kv head); lanesPerHead(headDim) threads share a unit and each owns one 16-byte
 * vector of the first rotate-half half and the matching vector of the second half, so RoPE pairs stay in-thread and
 * the k_norm sum of squares is a shuffle reduction inside the unit. All index/RoPE/norm/quantization math comes from
 * kvInjectionMath.h, which the CPU tests compile too.
 */
#include "dflash_trt/kvInjectionKernel.h"

namespace dflash_trt
{
namespace
{

constexpr int32_t kThreadsPerBlock = 256;

template <typename T, int32_t N>
struct alignas(sizeof(T) * N) Vec
{
    T v[N];
};

template <typename In, typename Cache>
__global__ void __launch_bounds__(kThreadsPerBlock) kvInjectionKernel(KVInjectionParams const p)
{
    __shared__ float invFreq[kMaxHeadDim / 2];
    int32_t const headDim = p.addressing.headDim;
    int32_t const half = headDim / 2;
    for (int32_t i = threadIdx.x; i < half; i += blockDim.x)
    {
        invFreq[i] = p.invFreq[i];
    }
    __syncthreads();

    int32_t const lanes = lanesPerHead(headDim);
    int32_t const heads = p.addressing.numKvHeads;
    int64_t const thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    int64_t const unit = thread / lanes;
    int32_t const lane = static_cast<int32_t>(thread % lanes);
    int64_t const unitsPerToken = static_cast<int64_t>(p.numLayers) * 2 * heads;
    int32_t const token = static_cast<int32_t>(unit / unitsPerToken);
    int32_t const inToken = static_cast<int32_t>(unit % unitsPerToken);
    int32_t const layer = inToken / (2 * heads);
    int32_t const kv = (inToken / heads) % 2;
    int32_t const head = inToken % heads;
    bool const active = token < p.numTokens && p.valid[token] != 0;

    // Every lane of the warp takes part in the shuffles below, so inactive lanes carry zeros instead of returning.
    int32_t const channel = lane * kElementsPerLane;
    Vec<In, kElementsPerLane> x0{}, x1{};
    if (active)
    {
        int64_t const base = ctxKvOffset(token, layer, kv, head, channel, p.numLayers, heads, headDim);
        auto const* src = static_cast<In const*>(p.ctxKv);
        x0 = *reinterpret_cast<Vec<In, kElementsPerLane> const*>(src + base);
        x1 = *reinterpret_cast<Vec<In, kElementsPerLane> const*>(src + base + half);
    }
    float f0[kElementsPerLane], f1[kElementsPerLane];
    float sumSquares = 0.f;
#pragma unroll
    for (int32_t j = 0; j < kElementsPerLane; ++j)
    {
        f0[j] = toFloat(x0.v[j]);
        f1[j] = toFloat(x1.v[j]);
        sumSquares += f0[j] * f0[j] + f1[j] * f1[j];
    }
    for (int32_t mask = lanes / 2; mask > 0; mask /= 2)
    {
        sumSquares += __shfl_xor_sync(0xffffffffu, sumSquares, mask, lanes);
    }
    if (!active)
    {
        return;
    }

    int32_t const position = p.positions[token];
    CacheLocation const loc
        = locateCacheElement(p.addressing, p.seqSlots[token], p.cachePositions[token], layer, kv, head, channel);
    void* const pool = loc.secondary ? p.secondaryPool : p.primaryPool;
    if (!loc.valid || pool == nullptr)
    {
        return;
    }

    if (kv == 0)
    {
        auto const* weight = static_cast<In const*>(p.kNormWeight) + static_cast<int64_t>(layer) * headDim + channel;
        auto const w0 = *reinterpret_cast<Vec<In, kElementsPerLane> const*>(weight);
        auto const w1 = *reinterpret_cast<Vec<In, kElementsPerLane> const*>(weight + half);
        float const invRms = inverseRms(sumSquares, headDim, p.eps);
#pragma unroll
        for (int32_t j = 0; j < kElementsPerLane; ++j)
        {
            float c, s;
            ropeCosSin(position, invFreq[channel + j], p.attentionScaling, c, s);
            normRopePair(f0[j], f1[j], invRms, toFloat(w0.v[j]), toFloat(w1.v[j]), c, s, f0[j], f1[j]);
        }
    }

    float const scale = p.scaleOrigQuant != nullptr ? *p.scaleOrigQuant : 1.f;
    Vec<Cache, kElementsPerLane> y0, y1;
#pragma unroll
    for (int32_t j = 0; j < kElementsPerLane; ++j)
    {
        y0.v[j] = toCache<Cache>(f0[j], scale);
        y1.v[j] = toCache<Cache>(f1[j], scale);
    }
    auto* dst = static_cast<Cache*>(pool) + loc.element;
    *reinterpret_cast<Vec<Cache, kElementsPerLane>*>(dst) = y0;
    *reinterpret_cast<Vec<Cache, kElementsPerLane>*>(dst + half) = y1;
}

template <typename In, typename Cache>
cudaError_t launchTyped(KVInjectionParams const& params, cudaStream_t stream)
{
    int32_t const lanes = lanesPerHead(params.addressing.headDim);
    int64_t const threads = static_cast<int64_t>(params.numTokens) * params.numLayers * 2
        * params.addressing.numKvHeads * lanes;
    int64_t const blocks = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
    kvInjectionKernel<In, Cache><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(params);
    return cudaGetLastError();
}

template <typename In>
cudaError_t launchForInput(KVInjectionParams const& params, CacheType cache, cudaStream_t stream)
{
    switch (cache)
    {
    case CacheType::kHALF: return launchTyped<In, __half>(params, stream);
    case CacheType::kBF16: return launchTyped<In, __nv_bfloat16>(params, stream);
    case CacheType::kFP8_E4M3: return launchTyped<In, __nv_fp8_e4m3>(params, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace

cudaError_t launchKvInjection(KVInjectionParams const& params, InputType input, CacheType cache, cudaStream_t stream)
{
    if (lanesPerHead(params.addressing.headDim) == 0 || params.addressing.tokensPerBlockLog2 < 0
        || (cache == CacheType::kFP8_E4M3 && params.scaleOrigQuant == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    if (params.numTokens <= 0 || params.numLayers <= 0 || params.addressing.numKvHeads <= 0)
    {
        return cudaSuccess;
    }
    switch (input)
    {
    case InputType::kHALF: return launchForInput<__half>(params, cache, stream);
    case InputType::kBF16: return launchForInput<__nv_bfloat16>(params, cache, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace dflash_trt
