#include "kvInjectionPlugin.h"

#include <cstring>
#include <utility>

using namespace nvinfer1;

namespace dflash_trt
{
namespace
{

// Field names: dflash_trt/trtllm/plugin.py `plugin_fields` spells the same list (a test compares them).
char const* const kFieldNumLayers = "num_layers";
char const* const kFieldNumKvHeads = "num_kv_heads";
char const* const kFieldHeadDim = "head_dim";
char const* const kFieldLayerIdxOffset = "layer_idx_offset";
char const* const kFieldTokensPerBlock = "tokens_per_block";
char const* const kFieldTypeId = "type_id";
char const* const kFieldCacheFp8 = "cache_fp8";
char const* const kFieldEps = "eps";
char const* const kFieldRopeInvFreq = "rope_inv_freq";
char const* const kFieldRopeAttentionScaling = "rope_attention_scaling";

struct IntField
{
    char const* name;
    int32_t KVInjectionConfig::*member;
};

IntField const kIntFields[] = {
    {kFieldNumLayers, &KVInjectionConfig::numLayers},
    {kFieldNumKvHeads, &KVInjectionConfig::numKvHeads},
    {kFieldHeadDim, &KVInjectionConfig::headDim},
    {kFieldLayerIdxOffset, &KVInjectionConfig::layerIdxOffset},
    {kFieldTokensPerBlock, &KVInjectionConfig::tokensPerBlock},
    {kFieldTypeId, &KVInjectionConfig::typeId},
    {kFieldCacheFp8, &KVInjectionConfig::cacheFp8},
};

} // namespace

std::string KVInjectionConfig::check() const
{
    if (numLayers <= 0 || numKvHeads <= 0)
    {
        return "num_layers and num_kv_heads must be positive";
    }
    if (lanesPerHead(headDim) == 0)
    {
        return "head_dim " + std::to_string(headDim) + " is not supported (a multiple of 16, at most 256, with "
            + "a power-of-two number of 16-element chunks)";
    }
    if (log2PowerOfTwo(tokensPerBlock) < 0)
    {
        return "tokens_per_block must be a power of two";
    }
    if (layerIdxOffset < 0)
    {
        return "layer_idx_offset must be non-negative";
    }
    if (typeId != static_cast<int32_t>(DataType::kHALF) && typeId != static_cast<int32_t>(DataType::kBF16))
    {
        return "type_id must be HALF or BF16";
    }
    if (static_cast<int32_t>(invFreq.size()) != headDim / 2)
    {
        return "rope_inv_freq must hold head_dim / 2 values";
    }
    return {};
}

int32_t KVInjectionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbOutputs != 1 || nbInputs != mConfig.nbInputs())
    {
        return -1;
    }
    outputTypes[0] = inputTypes[kPassthrough];
    return 0;
}

int32_t KVInjectionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
    DimsExprs* outputs, int32_t nbOutputs, IExprBuilder&) noexcept
{
    if (nbOutputs != 1 || nbInputs != mConfig.nbInputs())
    {
        return -1;
    }
    outputs[0] = inputs[kPassthrough];
    return 0;
}

bool KVInjectionPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != mConfig.nbInputs() || nbOutputs != 1 || pos < 0 || pos > nbInputs)
    {
        return false;
    }
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    if (pos == nbInputs)
    {
        return desc.type == inOut[kPassthrough].desc.type;
    }
    switch (pos)
    {
    case kCtxKv:
    case kKNormWeight: return desc.type == static_cast<DataType>(mConfig.typeId);
    case kPositions:
    case kCachePositions:
    case kSeqSlots:
    case kValid:
    case kBlockOffsets:
    case kPoolMapping: return desc.type == DataType::kINT32;
    case kPoolPointers: return desc.type == DataType::kINT64;
    case kPassthrough:
        return desc.type == DataType::kFLOAT || desc.type == DataType::kHALF || desc.type == DataType::kBF16
            || desc.type == DataType::kINT32;
    case kScaleOrigQuant: return desc.type == DataType::kFLOAT;
    default: return false;
    }
}

bool KVInjectionPlugin::checkShapes(Dims const* dims, int32_t nbInputs) const
{
    if (nbInputs != mConfig.nbInputs())
    {
        logError("DFlashKVInjection: expected " + std::to_string(mConfig.nbInputs()) + " inputs");
        return false;
    }
    Dims const& ctx = dims[kCtxKv];
    Dims const& weight = dims[kKNormWeight];
    Dims const& offsets = dims[kBlockOffsets];
    Dims const& pointers = dims[kPoolPointers];
    Dims const& mapping = dims[kPoolMapping];
    bool ok = ctx.nbDims == 2 && knownOrEqual(ctx.d[1], mConfig.ctxKvWidth());
    ok = ok && weight.nbDims == 2 && knownOrEqual(weight.d[0], mConfig.numLayers)
        && knownOrEqual(weight.d[1], mConfig.headDim);
    for (int32_t i : {kPositions, kCachePositions, kSeqSlots, kValid})
    {
        ok = ok && dims[i].nbDims == 1 && (ctx.d[0] < 0 || knownOrEqual(dims[i].d[0], ctx.d[0]));
    }
    ok = ok && offsets.nbDims == 4 && knownOrEqual(offsets.d[2], 2);
    ok = ok && pointers.nbDims == 2 && knownOrEqual(pointers.d[1], 2);
    ok = ok && mapping.nbDims == 2 && knownOrEqual(mapping.d[1], 2)
        && (mapping.d[0] < 0 || mapping.d[0] >= mConfig.layerIdxOffset + mConfig.numLayers);
    if (mConfig.cacheFp8)
    {
        ok = ok && volume(dims[kScaleOrigQuant]) == 1;
    }
    if (!ok)
    {
        logError("DFlashKVInjection: input shapes do not match num_layers/num_kv_heads/head_dim/layer_idx_offset");
    }
    return ok;
}

int32_t KVInjectionPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) noexcept
{
    std::vector<Dims> dims;
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims.push_back(in[i].desc.dims);
    }
    return checkShapes(dims.data(), nbInputs) ? 0 : -1;
}

int32_t KVInjectionPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const*, int32_t) noexcept
{
    std::vector<Dims> dims;
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims.push_back(in[i].dims);
    }
    return checkShapes(dims.data(), nbInputs) ? 0 : -1;
}

int32_t KVInjectionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void*, cudaStream_t stream) noexcept
{
    // Pool selection follows the GPT attention plugin: host_kv_cache_pool_mapping[layer] = {pool, layer in pool},
    // the pool's K/V base pointers come from host_kv_cache_pool_pointers[pool], its table from block_offsets[pool].
    Dims const& offsetsDims = inputDesc[kBlockOffsets].dims;
    auto const* mapping = static_cast<int32_t const*>(inputs[kPoolMapping]);
    int32_t const first = mConfig.layerIdxOffset;
    int32_t const pool = mapping[2 * first];
    int32_t const firstLayerInPool = mapping[2 * first + 1];
    for (int32_t l = 1; l < mConfig.numLayers; ++l)
    {
        if (mapping[2 * (first + l)] != pool || mapping[2 * (first + l) + 1] != firstLayerInPool + l)
        {
            logError("DFlashKVInjection: the draft layers must be consecutive layers of one KV pool");
            return -1;
        }
    }
    if (pool < 0 || pool >= offsetsDims.d[0] || pool >= inputDesc[kPoolPointers].dims.d[0])
    {
        logError("DFlashKVInjection: pool index out of range");
        return -1;
    }
    auto const* pointers = static_cast<int64_t const*>(inputs[kPoolPointers]);
    int64_t const seqs = offsetsDims.d[1];
    int64_t const maxBlocks = offsetsDims.d[3];

    KVInjectionParams params{};
    params.ctxKv = inputs[kCtxKv];
    params.kNormWeight = inputs[kKNormWeight];
    params.positions = static_cast<int32_t const*>(inputs[kPositions]);
    params.cachePositions = static_cast<int32_t const*>(inputs[kCachePositions]);
    params.seqSlots = static_cast<int32_t const*>(inputs[kSeqSlots]);
    params.valid = static_cast<int32_t const*>(inputs[kValid]);
    params.numTokens = static_cast<int32_t>(inputDesc[kCtxKv].dims.d[0]);
    params.numLayers = mConfig.numLayers;
    params.addressing = PagedKVAddressing{static_cast<int32_t const*>(inputs[kBlockOffsets]) + pool * seqs * 2 * maxBlocks,
        static_cast<int32_t>(seqs), static_cast<int32_t>(maxBlocks), log2PowerOfTwo(mConfig.tokensPerBlock),
        mConfig.numKvHeads, mConfig.headDim, firstLayerInPool};
    params.primaryPool = reinterpret_cast<void*>(pointers[2 * pool]);
    params.secondaryPool = reinterpret_cast<void*>(pointers[2 * pool + 1]);
    params.scaleOrigQuant = mConfig.cacheFp8 ? static_cast<float const*>(inputs[kScaleOrigQuant]) : nullptr;
    params.eps = mConfig.eps;
    params.attentionScaling = mConfig.attentionScaling;
    std::memcpy(params.invFreq, mConfig.invFreq.data(), mConfig.invFreq.size() * sizeof(float));

    bool const half = static_cast<DataType>(mConfig.typeId) == DataType::kHALF;
    InputType const input = half ? InputType::kHALF : InputType::kBF16;
    CacheType const cache = mConfig.cacheFp8 ? CacheType::kFP8_E4M3 : (half ? CacheType::kHALF : CacheType::kBF16);
    cudaError_t status = launchKvInjection(params, input, cache, stream);
    if (status == cudaSuccess)
    {
        size_t const bytes = volume(outputDesc[0].dims) * elementSize(outputDesc[0].type);
        status = cudaMemcpyAsync(outputs[0], inputs[kPassthrough], bytes, cudaMemcpyDeviceToDevice, stream);
    }
    if (status != cudaSuccess)
    {
        logError(std::string("DFlashKVInjection: ") + cudaGetErrorString(status));
        return -1;
    }
    return 0;
}

PluginFieldCollection const* KVInjectionPlugin::getFieldsToSerialize() noexcept
{
    mFields.clear();
    for (IntField const& f : kIntFields)
    {
        mFields.emplace_back(f.name, &(mConfig.*f.member), PluginFieldType::kINT32, 1);
    }
    mFields.emplace_back(kFieldEps, &mConfig.eps, PluginFieldType::kFLOAT32, 1);
    mFields.emplace_back(kFieldRopeInvFreq, mConfig.invFreq.data(), PluginFieldType::kFLOAT32,
        static_cast<int32_t>(mConfig.invFreq.size()));
    mFields.emplace_back(kFieldRopeAttentionScaling, &mConfig.attentionScaling, PluginFieldType::kFLOAT32, 1);
    return publishFields(mFields, mFieldCollection);
}

KVInjectionPluginCreator::KVInjectionPluginCreator()
{
    for (IntField const& f : kIntFields)
    {
        mFieldNames.emplace_back(f.name, nullptr, PluginFieldType::kINT32, 1);
    }
    mFieldNames.emplace_back(kFieldEps, nullptr, PluginFieldType::kFLOAT32, 1);
    mFieldNames.emplace_back(kFieldRopeInvFreq, nullptr, PluginFieldType::kFLOAT32, 0);
    mFieldNames.emplace_back(kFieldRopeAttentionScaling, nullptr, PluginFieldType::kFLOAT32, 1);
}

IPluginV3* KVInjectionPluginCreator::createPlugin(
    char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept
{
    try
    {
        KVInjectionConfig config;
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        {
            PluginField const& field = fc->fields[i];
            bool matched = false;
            for (IntField const& f : kIntFields)
            {
                if (std::strcmp(field.name, f.name) == 0 && field.type == PluginFieldType::kINT32 && field.length >= 1)
                {
                    config.*f.member = *static_cast<int32_t const*>(field.data);
                    matched = true;
                }
            }
            if (matched || field.type != PluginFieldType::kFLOAT32 || field.length < 1)
            {
                continue;
            }
            auto const* values = static_cast<float const*>(field.data);
            if (std::strcmp(field.name, kFieldEps) == 0)
            {
                config.eps = values[0];
            }
            else if (std::strcmp(field.name, kFieldRopeAttentionScaling) == 0)
            {
                config.attentionScaling = values[0];
            }
            else if (std::strcmp(field.name, kFieldRopeInvFreq) == 0)
            {
                config.invFreq.assign(values, values + field.length);
            }
        }
        std::string const problem = config.check();
        if (!problem.empty())
        {
            logError("DFlashKVInjection: " + problem);
            return nullptr;
        }
        return new KVInjectionPlugin(std::move(config), mNamespace);
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

} // namespace dflash_trt
