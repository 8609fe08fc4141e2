/*
 * DFlashAttention: TensorRT IPluginV3 wrapper of the DFlashAttention kernels for TensorRT-LLM 1.2.x engines. It
 * serves the generation requests of one attention layer: n new tokens per request (K + 1 verified tokens, or a B
 * token draft block), RoPE and the K / V write into the paged pool as the GPT attention plugin's generation step
 * does, then attention over the past and the new tokens with a causal or full block mask and an optional window
 * (counted from each query, or from the block's anchor), or with the runtime's packed tree mask and position offsets
 * (a draft tree's verification: block_mask 2, no window).
 *
 * Inputs (in this order; dflash_trt/trtllm/plugin.py adds them the same way):
 *   0 qkv                          [tokens, (heads + 2 kv_heads) * head_dim]  fp16 | bf16 (= type_id), the
 *                                  requests' rows packed in request order, after the q/k norms
 *   1 sequence_length              [requests] int32: past + new tokens
 *   2 generation_lengths           [requests] int32: new tokens
 *   3 rotary_cos_sin               float32, float2 [max_positions][head_dim / 2] (the attention plugin's table)
 *   4 kv_cache_block_offsets       [pools, seqs, 2, max_blocks_per_seq] int32 (device); the requests are its last
 *                                  `requests` rows (generation requests follow the step's context requests)
 *   5 host_kv_cache_pool_pointers  [pools, 2] int64 (host)
 *   6 host_kv_cache_pool_mapping   [layers_total, 2] int32 (host)
 *   7 host_past_key_value_lengths  [seqs] int32 (host): the runtime's bounds, last `requests` entries used (they
 *                                  size the key split only)
 *   then, only with block_mask 2 (a draft tree's verification), the runtime's spec-decoding inputs:
 *     spec_decoding_position_offsets [requests, >= 1] int32: node t's RoPE position is past + offsets[r][t]
 *     spec_decoding_packed_mask      [>= tokens, ceil(max_query_len / 32)] int32: row of node t of request r =
 *                                    r's first packed row + t; bit j % 32 of word j / 32 = sees block key j
 *   then, only with cache_fp8:
 *     kv_scale_orig_quant          [1] float32
 *     kv_scale_quant_orig          [1] float32
 * Output 0: [tokens, heads * head_dim], the input type.
 */
#pragma once

#include "dflash_trt/attentionKernel.h"
#include "pluginBase.h"
#include "pluginUtils.h"

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace dflash_trt
{

constexpr char const* kAttentionPluginName = "DFlashAttention";
constexpr char const* kAttentionPluginVersion = "1";

enum AttentionInput : int32_t
{
    kQkv = 0,
    kSequenceLength,
    kGenerationLengths,
    kRotaryCosSin,
    kAttnBlockOffsets,
    kAttnPoolPointers,
    kAttnPoolMapping,
    kHostPastLengths,
    kOptionalInputs, //!< the first of the tree's two inputs, then of the FP8 scales (AttentionConfig says where)
};

//! Creation / serialization fields of the plugin.
struct AttentionConfig
{
    int32_t numHeads{0};
    int32_t numKvHeads{0};
    int32_t headDim{0};
    int32_t layerIdx{0};
    int32_t tokensPerBlock{0};
    int32_t maxQueryLen{0};
    int32_t blockMask{0};
    int32_t slidingWindow{0};
    int32_t windowFromAnchor{0};
    int32_t maxPositions{0};
    int32_t typeId{static_cast<int32_t>(nvinfer1::DataType::kBF16)};
    int32_t cacheFp8{0};
    float qScaling{1.f};

    //! Empty when usable, else why not.
    std::string check() const;
    bool tree() const
    {
        return blockMask == static_cast<int32_t>(BlockMask::kTree);
    }
    int32_t positionOffsetsInput() const
    {
        return kOptionalInputs;
    }
    int32_t packedMaskInput() const
    {
        return kOptionalInputs + 1;
    }
    int32_t kvScaleOrigQuantInput() const
    {
        return kOptionalInputs + (tree() ? 2 : 0);
    }
    int32_t kvScaleQuantOrigInput() const
    {
        return kvScaleOrigQuantInput() + 1;
    }
    int32_t nbInputs() const
    {
        return kvScaleOrigQuantInput() + (cacheFp8 ? 2 : 0);
    }
    int64_t qkvWidth() const
    {
        return static_cast<int64_t>(numHeads + 2 * numKvHeads) * headDim;
    }
};

class AttentionPlugin : public PluginV3Base<AttentionPlugin, AttentionConfig>
{
public:
    static constexpr char const* kPluginName = kAttentionPluginName;
    static constexpr char const* kPluginVersion = kAttentionPluginVersion;

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
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    //! Shape checks shared by build and runtime; dims of -1 (unknown at build time) pass.
    bool checkShapes(nvinfer1::Dims const* dims, int32_t nbInputs) const;
    //! The launch parameters of one enqueue, or an error message.
    std::string describeLaunch(nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
        void* const* outputs, void* workspace, AttentionLaunch& launch, int32_t& maxKeys) const;

    int32_t mMultiProcessorCount{0};
};

class AttentionPluginCreator : public PluginCreatorBase<AttentionPlugin>
{
public:
    AttentionPluginCreator();

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

} // namespace dflash_trt
