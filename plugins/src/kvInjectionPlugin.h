/*
 * DFlashKVInjection: TensorRT IPluginV3 wrapper of the KV-injection kernel for TensorRT-LLM 1.2.x engines.
 *
 * Inputs (in this order; dflash_trt/trtllm/plugin.py adds them the same way):
 *   0 ctx_kv                       [tokens, layers * 2 * kv_heads * head_dim]  fp16 | bf16 (= type_id)
 *   1 k_norm_weight                [layers, head_dim]                          same type
 *   2 positions                    [tokens] int32
 *   3 seq_slots                    [tokens] int32
 *   4 valid                        [tokens] int32
 *   5 kv_cache_block_offsets       [pools, seqs, 2, max_blocks_per_seq] int32 (device)
 *   6 host_kv_cache_pool_pointers  [pools, 2] int64 (host)
 *   7 host_kv_cache_pool_mapping   [layers_total, 2] int32 (host): pool index, layer index inside the pool
 *   8 passthrough                  any shape; fp32 | fp16 | bf16 | int32
 *   9 kv_scale_orig_quant          [1] float32, only with cache_fp8
 * Output 0: a copy of `passthrough`, produced after the cache write so consumers are ordered after it.
 */
#pragma once

#include "dflash_trt/kvInjectionKernel.h"
#include "pluginBase.h"
#include "pluginUtils.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace dflash_trt
{

constexpr char const* kKvInjectionPluginName = "DFlashKVInjection";
constexpr char const* kKvInjectionPluginVersion = "1";

enum KVInjectionInput : int32_t
{
    kCtxKv = 0,
    kKNormWeight,
    kPositions,
    kCachePositions,
    kSeqSlots,
    kValid,
    kBlockOffsets,
    kPoolPointers,
    kPoolMapping,
    kPassthrough,
    kScaleOrigQuant,
};

//! Creation / serialization fields of the plugin.
struct KVInjectionConfig
{
    int32_t numLayers{0};
    int32_t numKvHeads{0};
    int32_t headDim{0};
    int32_t layerIdxOffset{0};
    int32_t tokensPerBlock{0};
    int32_t typeId{static_cast<int32_t>(nvinfer1::DataType::kBF16)};
    int32_t cacheFp8{0};
    float eps{1e-6f};
    float attentionScaling{1.f};
    std::vector<float> invFreq;

    //! Empty when usable, else why not.
    std::string check() const;
    int32_t nbInputs() const
    {
        return cacheFp8 ? kScaleOrigQuant + 1 : kScaleOrigQuant;
    }
    int64_t ctxKvWidth() const
    {
        return static_cast<int64_t>(numLayers) * 2 * numKvHeads * headDim;
    }
};

class KVInjectionPlugin : public PluginV3Base<KVInjectionPlugin, KVInjectionConfig>
{
public:
    static constexpr char const* kPluginName = kKvInjectionPluginName;
    static constexpr char const* kPluginVersion = kKvInjectionPluginVersion;

    using PluginV3Base::PluginV3Base;

    // IPluginV3OneBuild
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    //! Shape checks shared by build and runtime; dims of -1 (unknown at build time) pass.
    bool checkShapes(nvinfer1::Dims const* dims, int32_t nbInputs) const;

};

class KVInjectionPluginCreator : public PluginCreatorBase<KVInjectionPlugin>
{
public:
    KVInjectionPluginCreator();

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

} // namespace dflash_trt
