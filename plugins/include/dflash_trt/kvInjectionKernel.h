/*
 * Launch interface of the DFlash KV-injection kernel: one launch writes K = RoPE(k_norm(k_raw)) and V = v_raw of
 * every valid token into all draft layers' pages. Needs only CUDA; the TensorRT plugin and the tests call this.
 */
#pragma once

#include "dflash_trt/kvInjectionMath.h"

#include <cuda_runtime_api.h>

namespace dflash_trt
{

enum class InputType : int32_t
{
    kHALF = 0,
    kBF16 = 1,
};

struct KVInjectionParams
{
    void const* ctxKv;       //!< [numTokens][numLayers][2][numKvHeads][headDim] of the input type
    void const* kNormWeight; //!< [numLayers][headDim] of the input type
    int32_t const* positions;      //!< RoPE position of each token
    int32_t const* cachePositions; //!< cache slot each token is written at (its position, except a tree's moved nodes)
    int32_t const* seqSlots;
    int32_t const* valid;
    int32_t numTokens;
    int32_t numLayers;
    PagedKVAddressing addressing;
    void* primaryPool;
    void* secondaryPool;           //!< may be null: tokens whose block sits there are then skipped
    float const* scaleOrigQuant;   //!< device float[1]; FP8 cache only
    float eps;
    float attentionScaling;
    float invFreq[kMaxHeadDim / 2]; //!< RoPE inverse frequencies, headDim / 2 used
};

//! Enqueue the kernel on `stream`; returns the launch error (cudaSuccess for an empty batch).
cudaError_t launchKvInjection(KVInjectionParams const& params, InputType input, CacheType cache, cudaStream_t stream);

} // namespace dflash_trt
