#include "attentionPlugin.h"

#include <algorithm>
#include <cstring>
#include <utility>

using namespace nvinfer1;

namespace dflash_trt
{
namespace
{

// Field names: dflash_trt/trtllm/plugin.py `attention_plugin_fields` spells the same list (a test compares them).
char const* const kFieldNumHeads = "num_heads";
char const* const kFieldNumKvHeads = "num_kv_heads";
char const* const kFieldHeadDim = "head_dim";
char const* const kFieldLayerIdx = "layer_idx";
char const* const kFieldTokensPerBlock = "tokens_per_block";
char const* const kFieldMaxQueryLen = "max_query_len";
char const* const kFieldBlockMask = "block_mask";
char const* const kFieldSlidingWindow = "sliding_window";
char const* const kFieldWindowFromAnchor = "window_from_anchor";
char const* const kFieldMaxPositions = "max_positions";
char const* const kFieldTypeId = "type_id";
char const* const kFieldCacheFp8 = "cache_fp8";
char const* const kFieldQScaling = "q_scaling";

struct IntField
{
    char const* name;
    int32_t AttentionConfig::*member;
};

IntField const kIntFields[] = {
    {kFieldNumHeads, &AttentionConfig::numHeads},
    {kFieldNumKvHeads, &AttentionConfig::numKvHeads},
    {kFieldHeadDim, &AttentionConfig::headDim},
    {kFieldLayerIdx, &AttentionConfig::layerIdx},
    {kFieldTokensPerBlock, &AttentionConfig::tokensPerBlock},
    {kFieldMaxQueryLen, &AttentionConfig::maxQueryLen},
    {kFieldBlockMask, &AttentionConfig::blockMask},
    {kFieldSlidingWindow, &AttentionConfig::slidingWindow},
    {kFieldWindowFromAnchor, &AttentionConfig::windowFromAnchor},
    {kFieldMaxPositions, &AttentionConfig::maxPositions},
    {kFieldTypeId, &AttentionConfig::typeId},
    {kFieldCacheFp8, &AttentionConfig::cacheFp8},
};

} // namespace

std::string AttentionConfig::check() const
{
    if (numHeads <= 0 || numKvHeads <= 0 || numHeads % numKvHeads != 0)
    {
        return "num_heads must be a positive multiple of num_kv_heads";
    }
    if (!supportedAttentionHeadDim(headDim))
    {
        return "head_dim " + std::to_string(headDim) + " is not supported (32, 64, 128 or 256)";
    }
    if (log2PowerOfTwo(tokensPerBlock) < 0)
    {
        return "tokens_per_block must be a power of two";
    }
    if (layerIdx < 0 || maxQueryLen <= 0 || maxPositions <= 0 || slidingWindow < 0)
    {
        return "layer_idx, sliding_window must be non-negative and max_query_len, max_positions positive";
    }
    if (blockMask < static_cast<int32_t>(BlockMask::kCausal) || blockMask > static_cast<int32_t>(BlockMask::kTree))
    {
        return "block_mask must be 0 (causal), 1 (full) or 2 (the runtime's packed tree mask)";
    }
    if (tree() && slidingWindow != 0)
    {
        return "a tree mask (block_mask 2) takes no sliding window";
    }
    if (windowFromAnchor != 0 && windowFromAnchor != 1)
    {
        return "window_from_anchor must be 0 (the window counts from each query) or 1 (from the block's anchor)";
    }
    if (typeId != static_cast<int32_t>(DataType::kHALF) && typeId != static_cast<int32_t>(DataType::kBF16))
    {
        return "type_id must be HALF or BF16";
    }
    if (!(qScaling > 0.f))
    {
        return "q_scaling must be positive";
    }
    return {};
}

int32_t AttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbOutputs != 1 || nbInputs != mConfig.nbInputs())
    {
        return -1;
    }
    outputTypes[0] = inputTypes[kQkv];
    return 0;
}

int32_t AttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
    DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept
{
    if (nbOutputs != 1 || nbInputs != mConfig.nbInputs() || inputs[kQkv].nbDims != 2)
    {
        return -1;
    }
    outputs[0].nbDims = 2;
    outputs[0].d[0] = inputs[kQkv].d[0];
    outputs[0].d[1] = exprBuilder.constant(static_cast<int64_t>(mConfig.numHeads) * mConfig.headDim);
    return 0;
}

bool AttentionPlugin::supportsFormatCombination(
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
        return desc.type == static_cast<DataType>(mConfig.typeId);
    }
    if (pos >= kOptionalInputs)
    {
        bool const treeInput = mConfig.tree() && pos < mConfig.kvScaleOrigQuantInput();
        return desc.type == (treeInput ? DataType::kINT32 : DataType::kFLOAT);
    }
    switch (pos)
    {
    case kQkv: return desc.type == static_cast<DataType>(mConfig.typeId);
    case kSequenceLength:
    case kGenerationLengths:
    case kAttnBlockOffsets:
    case kAttnPoolMapping:
    case kHostPastLengths: return desc.type == DataType::kINT32;
    case kAttnPoolPointers: return desc.type == DataType::kINT64;
    case kRotaryCosSin: return desc.type == DataType::kFLOAT;
    default: return false;
    }
}

bool AttentionPlugin::checkShapes(Dims const* dims, int32_t nbInputs) const
{
    if (nbInputs != mConfig.nbInputs())
    {
        logError("DFlashAttention: expected " + std::to_string(mConfig.nbInputs()) + " inputs");
        return false;
    }
    Dims const& qkv = dims[kQkv];
    Dims const& offsets = dims[kAttnBlockOffsets];
    Dims const& mapping = dims[kAttnPoolMapping];
    int64_t const table = volume(dims[kRotaryCosSin]);
    bool ok = qkv.nbDims == 2 && knownOrEqual(qkv.d[1], mConfig.qkvWidth());
    ok = ok && dims[kSequenceLength].nbDims == 1 && dims[kGenerationLengths].nbDims == 1;
    ok = ok && (dims[kSequenceLength].d[0] < 0 || knownOrEqual(dims[kGenerationLengths].d[0], dims[kSequenceLength].d[0]));
    ok = ok && (table < 0 || table >= static_cast<int64_t>(mConfig.maxPositions) * mConfig.headDim);
    ok = ok && offsets.nbDims == 4 && knownOrEqual(offsets.d[2], 2);
    ok = ok && dims[kAttnPoolPointers].nbDims == 2 && knownOrEqual(dims[kAttnPoolPointers].d[1], 2);
    ok = ok && mapping.nbDims == 2 && knownOrEqual(mapping.d[1], 2) && (mapping.d[0] < 0 || mapping.d[0] > mConfig.layerIdx);
    ok = ok && dims[kHostPastLengths].nbDims == 1;
    if (mConfig.tree())
    {
        Dims const& positionOffsets = dims[mConfig.positionOffsetsInput()];
        Dims const& packedMask = dims[mConfig.packedMaskInput()];
        int64_t const words = (mConfig.maxQueryLen + 31) / 32;
        ok = ok && positionOffsets.nbDims == 2 && positionOffsets.d[1] != 0;
        ok = ok && packedMask.nbDims == 2 && (packedMask.d[1] < 0 || packedMask.d[1] >= words);
        ok = ok && (packedMask.d[0] < 0 || qkv.d[0] < 0 || packedMask.d[0] >= qkv.d[0]);
    }
    if (mConfig.cacheFp8)
    {
        ok = ok && volume(dims[mConfig.kvScaleOrigQuantInput()]) == 1 && volume(dims[mConfig.kvScaleQuantOrigInput()]) == 1;
    }
    if (!ok)
    {
        logError("DFlashAttention: input shapes do not match num_heads/num_kv_heads/head_dim/layer_idx/max_positions");
    }
    return ok;
}

int32_t AttentionPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) noexcept
{
    std::vector<Dims> dims;
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims.push_back(in[i].desc.dims);
    }
    return checkShapes(dims.data(), nbInputs) ? 0 : -1;
}

size_t AttentionPlugin::getWorkspaceSize(
    DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) const noexcept
{
    if (nbInputs != mConfig.nbInputs())
    {
        return 0;
    }
    int64_t const maxTokens = std::max<int64_t>(inputs[kQkv].max.d[0], 1);
    auto const bytes = static_cast<int32_t>(elementSize(static_cast<DataType>(mConfig.typeId)));
    return static_cast<size_t>(attentionWorkspaceBound(maxTokens, mConfig.numHeads, mConfig.headDim, bytes));
}

int32_t AttentionPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const*, int32_t) noexcept
{
    std::vector<Dims> dims;
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims.push_back(in[i].dims);
    }
    return checkShapes(dims.data(), nbInputs) ? 0 : -1;
}

std::string AttentionPlugin::describeLaunch(PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* workspace, AttentionLaunch& launch, int32_t& maxKeys) const
{
    // Pool selection as the GPT attention plugin does it: host_kv_cache_pool_mapping[layer] = {pool, layer in
    // pool}; the pool's base pointers come from host_kv_cache_pool_pointers[pool], its table from offsets[pool].
    Dims const& offsets = inputDesc[kAttnBlockOffsets].dims;
    auto const* mapping = static_cast<int32_t const*>(inputs[kAttnPoolMapping]);
    int32_t const pool = mapping[2 * mConfig.layerIdx];
    int32_t const layerInPool = mapping[2 * mConfig.layerIdx + 1];
    if (pool < 0 || pool >= offsets.d[0] || pool >= inputDesc[kAttnPoolPointers].dims.d[0] || layerInPool < 0)
    {
        return "pool index out of range";
    }
    int64_t const requests = inputDesc[kSequenceLength].dims.d[0];
    int64_t const seqs = offsets.d[1];
    int64_t const pastSeqs = inputDesc[kHostPastLengths].dims.d[0];
    if (requests > seqs || requests > pastSeqs)
    {
        return "more generation requests than rows of kv_cache_block_offsets / host_past_key_value_lengths";
    }
    int64_t const maxBlocks = offsets.d[3];
    auto const* table = static_cast<int32_t const*>(inputs[kAttnBlockOffsets]);
    auto const* pointers = static_cast<int64_t const*>(inputs[kAttnPoolPointers]);
    launch.qkv = inputs[kQkv];
    launch.out = outputs[0];
    launch.seqLens = static_cast<int32_t const*>(inputs[kSequenceLength]);
    launch.genLens = static_cast<int32_t const*>(inputs[kGenerationLengths]);
    launch.cosSin = static_cast<float const*>(inputs[kRotaryCosSin]);
    launch.addressing = PagedKVAddressing{table + (pool * seqs + (seqs - requests)) * 2 * maxBlocks,
        static_cast<int32_t>(requests), static_cast<int32_t>(maxBlocks), log2PowerOfTwo(mConfig.tokensPerBlock),
        mConfig.numKvHeads, mConfig.headDim, layerInPool};
    launch.primaryPool = reinterpret_cast<void*>(pointers[2 * pool]);
    launch.secondaryPool = reinterpret_cast<void*>(pointers[2 * pool + 1]);
    launch.scaleOrigQuant
        = mConfig.cacheFp8 ? static_cast<float const*>(inputs[mConfig.kvScaleOrigQuantInput()]) : nullptr;
    launch.scaleQuantOrig
        = mConfig.cacheFp8 ? static_cast<float const*>(inputs[mConfig.kvScaleQuantOrigInput()]) : nullptr;
    if (mConfig.tree())
    {
        if (inputDesc[mConfig.positionOffsetsInput()].dims.d[0] < requests
            || inputDesc[mConfig.packedMaskInput()].dims.d[0] < inputDesc[kQkv].dims.d[0])
        {
            return "fewer spec-decoding position-offset rows than requests or packed-mask rows than tokens";
        }
        launch.tree = TreeMask{static_cast<int32_t const*>(inputs[mConfig.positionOffsetsInput()]),
            static_cast<int32_t>(inputDesc[mConfig.positionOffsetsInput()].dims.d[1]),
            static_cast<int32_t const*>(inputs[mConfig.packedMaskInput()]),
            static_cast<int32_t>(inputDesc[mConfig.packedMaskInput()].dims.d[1])};
    }
    launch.workspace = workspace;
    launch.numRequests = static_cast<int32_t>(requests);
    launch.numTokens = static_cast<int32_t>(inputDesc[kQkv].dims.d[0]);
    launch.numHeads = mConfig.numHeads;
    launch.maxQueryLen = mConfig.maxQueryLen;
    launch.maxPositions = mConfig.maxPositions;
    launch.window = KeyWindow{mConfig.slidingWindow, mConfig.windowFromAnchor ? WindowAnchor::kBlock : WindowAnchor::kQuery};
    launch.mask = static_cast<BlockMask>(mConfig.blockMask);
    launch.qScaling = mConfig.qScaling;
    auto const* hostPast = static_cast<int32_t const*>(inputs[kHostPastLengths]) + (pastSeqs - requests);
    maxKeys = requests > 0 ? *std::max_element(hostPast, hostPast + requests) + mConfig.maxQueryLen : 0;
    return {};
}

int32_t AttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    if (inputDesc[kQkv].dims.d[0] == 0 || inputDesc[kSequenceLength].dims.d[0] == 0)
    {
        return 0;
    }
    AttentionLaunch launch{};
    int32_t maxKeys = 0;
    std::string const problem = describeLaunch(inputDesc, inputs, outputs, workspace, launch, maxKeys);
    if (!problem.empty())
    {
        logError("DFlashAttention: " + problem);
        return -1;
    }
    cudaError_t status = cudaSuccess;
    if (mMultiProcessorCount == 0)
    {
        int device = 0;
        status = cudaGetDevice(&device);
        if (status == cudaSuccess)
        {
            status = cudaDeviceGetAttribute(&mMultiProcessorCount, cudaDevAttrMultiProcessorCount, device);
        }
    }
    if (status == cudaSuccess)
    {
        bool const half = static_cast<DataType>(mConfig.typeId) == DataType::kHALF;
        InputType const input = half ? InputType::kHALF : InputType::kBF16;
        CacheType const cache = mConfig.cacheFp8 ? CacheType::kFP8_E4M3 : (half ? CacheType::kHALF : CacheType::kBF16);
        status = launchDflashAttention(launch, input, cache, maxKeys, mMultiProcessorCount, stream);
    }
    if (status != cudaSuccess)
    {
        logError(std::string("DFlashAttention: ") + cudaGetErrorString(status));
        return -1;
    }
    return 0;
}

PluginFieldCollection const* AttentionPlugin::getFieldsToSerialize() noexcept
{
    mFields.clear();
    for (IntField const& f : kIntFields)
    {
        mFields.emplace_back(f.name, &(mConfig.*f.member), PluginFieldType::kINT32, 1);
    }
    mFields.emplace_back(kFieldQScaling, &mConfig.qScaling, PluginFieldType::kFLOAT32, 1);
    return publishFields(mFields, mFieldCollection);
}

AttentionPluginCreator::AttentionPluginCreator()
{
    for (IntField const& f : kIntFields)
    {
        mFieldNames.emplace_back(f.name, nullptr, PluginFieldType::kINT32, 1);
    }
    mFieldNames.emplace_back(kFieldQScaling, nullptr, PluginFieldType::kFLOAT32, 1);
}

IPluginV3* AttentionPluginCreator::createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept
{
    try
    {
        AttentionConfig config;
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        {
            PluginField const& field = fc->fields[i];
            for (IntField const& f : kIntFields)
            {
                if (std::strcmp(field.name, f.name) == 0 && field.type == PluginFieldType::kINT32 && field.length >= 1)
                {
                    config.*f.member = *static_cast<int32_t const*>(field.data);
                }
            }
            if (std::strcmp(field.name, kFieldQScaling) == 0 && field.type == PluginFieldType::kFLOAT32
                && field.length >= 1)
            {
                config.qScaling = *static_cast<float const*>(field.data);
            }
        }
        std::string const problem = config.check();
        if (!problem.empty())
        {
            logError("DFlashAttention: " + problem);
            return nullptr;
        }
        return new AttentionPlugin(std::move(config), mNamespace);
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

} // namespace dflash_trt
