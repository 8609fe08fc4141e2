/*
 * CPU driver of the KV-injection math: runs the same __host__ __device__ functions as the CUDA kernel over host
 * buffers, exported with C linkage so tests/engine/test_kernels_host.py can call it through ctypes and compare with the
 * torch definition. Build: g++ -std=c++17 -shared -fPIC -I plugins/include -I <cuda>/include.
 */
#include "dflash_trt/kvInjectionMath.h"

#include <cstdint>
#include <vector>

using namespace dflash_trt;

namespace
{

template <typename In, typename Cache>
int32_t injectTyped(In const* ctxKv, In const* kNormWeight, int32_t const* positions,
    int32_t const* cachePositions, int32_t const* seqSlots,
    int32_t const* valid, int32_t numTokens, int32_t numLayers, PagedKVAddressing const& a, Cache* primaryPool,
    Cache* secondaryPool, float scaleOrigQuant, float eps, float const* invFreq, float attentionScaling)
{
    int32_t const headDim = a.headDim;
    int32_t const half = headDim / 2;
    int32_t written = 0;
    std::vector<float> x(headDim);
    for (int32_t t = 0; t < numTokens; ++t)
    {
        if (valid[t] == 0)
        {
            continue;
        }
        bool wroteAll = true;
        for (int32_t layer = 0; layer < numLayers; ++layer)
        {
            for (int32_t kv = 0; kv < 2; ++kv)
            {
                for (int32_t head = 0; head < a.numKvHeads; ++head)
                {
                    float sumSquares = 0.f;
                    for (int32_t i = 0; i < headDim; ++i)
                    {
                        x[i] = toFloat(ctxKv[ctxKvOffset(t, layer, kv, head, i, numLayers, a.numKvHeads, headDim)]);
                        sumSquares += x[i] * x[i];
                    }
                    float const invRms = inverseRms(sumSquares, headDim, eps);
                    for (int32_t i = 0; i < half; ++i)
                    {
                        float out0 = x[i];
                        float out1 = x[i + half];
                        if (kv == 0)
                        {
                            float c, s;
                            ropeCosSin(positions[t], invFreq[i], attentionScaling, c, s);
                            float const w0 = toFloat(kNormWeight[layer * headDim + i]);
                            float const w1 = toFloat(kNormWeight[layer * headDim + i + half]);
                            normRopePair(x[i], x[i + half], invRms, w0, w1, c, s, out0, out1);
                        }
                        CacheLocation const lo
                            = locateCacheElement(a, seqSlots[t], cachePositions[t], layer, kv, head, i);
                        CacheLocation const hi
                            = locateCacheElement(a, seqSlots[t], cachePositions[t], layer, kv, head, i + half);
                        Cache* pool = lo.secondary ? secondaryPool : primaryPool;
                        if (!lo.valid || pool == nullptr)
                        {
                            wroteAll = false;
                            continue;
                        }
                        pool[lo.element] = toCache<Cache>(out0, scaleOrigQuant);
                        pool[hi.element] = toCache<Cache>(out1, scaleOrigQuant);
                    }
                }
            }
        }
        written += wroteAll ? 1 : 0;
    }
    return written;
}

template <typename In>
int32_t injectForInput(void const* ctxKv, void const* kNormWeight, int32_t const* positions,
    int32_t const* cachePositions, int32_t const* seqSlots,
    int32_t const* valid, int32_t numTokens, int32_t numLayers, PagedKVAddressing const& a, void* primaryPool,
    void* secondaryPool, int32_t cacheType, float scaleOrigQuant, float eps, float const* invFreq,
    float attentionScaling)
{
    auto const* in = static_cast<In const*>(ctxKv);
    auto const* w = static_cast<In const*>(kNormWeight);
    switch (static_cast<CacheType>(cacheType))
    {
    case CacheType::kHALF:
        return injectTyped(in, w, positions, cachePositions, seqSlots, valid, numTokens, numLayers, a,
            static_cast<__half*>(primaryPool), static_cast<__half*>(secondaryPool), scaleOrigQuant, eps, invFreq,
            attentionScaling);
    case CacheType::kBF16:
        return injectTyped(in, w, positions, cachePositions, seqSlots, valid, numTokens, numLayers, a,
            static_cast<__nv_bfloat16*>(primaryPool), static_cast<__nv_bfloat16*>(secondaryPool), scaleOrigQuant, eps,
            invFreq, attentionScaling);
    case CacheType::kFP8_E4M3:
        return injectTyped(in, w, positions, cachePositions, seqSlots, valid, numTokens, numLayers, a,
            static_cast<__nv_fp8_e4m3*>(primaryPool), static_cast<__nv_fp8_e4m3*>(secondaryPool), scaleOrigQuant,
            eps, invFreq, attentionScaling);
    }
    return -1;
}

} // namespace

extern "C"
{

//! Inject on the CPU; returns the number of valid tokens fully written, or -1 for an unsupported configuration.
int32_t dflashKvInjectionHost(void const* ctxKv, void const* kNormWeight, int32_t inputType, int32_t const* positions,
    int32_t const* cachePositions, int32_t const* seqSlots, int32_t const* valid, int32_t numTokens, int32_t numLayers, int32_t numKvHeads,
    int32_t headDim, int32_t const* blockOffsets, int32_t numSeqs, int32_t maxBlocksPerSeq, int32_t tokensPerBlock,
    int32_t firstLayerInPool, void* primaryPool, void* secondaryPool, int32_t cacheType, float scaleOrigQuant,
    float eps, float const* invFreq, float attentionScaling)
{
    int32_t const log2Tokens = log2PowerOfTwo(tokensPerBlock);
    if (lanesPerHead(headDim) == 0 || log2Tokens < 0)
    {
        return -1;
    }
    PagedKVAddressing const a{blockOffsets, numSeqs, maxBlocksPerSeq, log2Tokens, numKvHeads, headDim, firstLayerInPool};
    switch (static_cast<int32_t>(inputType))
    {
    case 0:
        return injectForInput<__half>(ctxKv, kNormWeight, positions, cachePositions, seqSlots, valid, numTokens,
            numLayers, a, primaryPool, secondaryPool, cacheType, scaleOrigQuant, eps, invFreq, attentionScaling);
    case 1:
        return injectForInput<__nv_bfloat16>(ctxKv, kNormWeight, positions, cachePositions, seqSlots, valid,
            numTokens, numLayers, a, primaryPool, secondaryPool, cacheType, scaleOrigQuant, eps, invFreq, attentionScaling);
    default: return -1;
    }
}

//! Element offset of (seq, position, layer, kv, head, channel); -1 when unresolvable, and *secondary set.
int64_t dflashLocateCacheElement(int32_t const* blockOffsets, int32_t numSeqs, int32_t maxBlocksPerSeq,
    int32_t tokensPerBlock, int32_t numKvHeads, int32_t headDim, int32_t firstLayerInPool, int32_t seq,
    int32_t position, int32_t layer, int32_t kv, int32_t head, int32_t channel, int32_t* secondary)
{
    PagedKVAddressing const a{blockOffsets, numSeqs, maxBlocksPerSeq, log2PowerOfTwo(tokensPerBlock), numKvHeads,
        headDim, firstLayerInPool};
    CacheLocation const loc = locateCacheElement(a, seq, position, layer, kv, head, channel);
    *secondary = loc.secondary ? 1 : 0;
    return loc.valid ? loc.element : -1;
}

//! The FP8 e4m3 byte the kernel stores for x.
uint8_t dflashToFp8(float x, float scaleOrigQuant)
{
    return toCache<__nv_fp8_e4m3>(x, scaleOrigQuant).__x;
}

int32_t dflashLanesPerHead(int32_t headDim)
{
    return lanesPerHead(headDim);
}

} // extern "C"
