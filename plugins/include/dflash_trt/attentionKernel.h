/*
 * Launch interface of the DFlashAttention kernels: multi-token (spec-decoding) generation attention over
 * TensorRT-LLM 1.2.x's paged KV pool. Needs only CUDA; the TensorRT plugin and the GPU tests call this.
 */
#pragma once

#include "dflash_trt/attentionCta.h"
#include "dflash_trt/kvInjectionKernel.h"

#include <cuda_runtime_api.h>

namespace dflash_trt
{

//! Enqueue prepare, attend and (with split keys) combine on `stream`. `maxKeys` bounds every request's sequence
//! length (host knowledge, e.g. the runtime's host past-length bounds plus the new tokens) and sizes the split;
//! the workspace must hold attentionWorkspaceBound(numTokens, ...). Returns the first launch error.
cudaError_t launchDflashAttention(AttentionLaunch params, InputType input, CacheType cache, int32_t maxKeys,
    int32_t multiProcessorCount, cudaStream_t stream);

} // namespace dflash_trt
