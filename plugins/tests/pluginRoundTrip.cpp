/*
 * CPU check of the IPluginV3 glue, built against TensorRT headers only (no libnvinfer, no GPU): creation fields ->
 * plugin -> serialized fields -> plugin, the dtype table of supportsFormatCombination, shape checks, and refusal of
 * bad configurations. Prints one line per failed check and exits non-zero on any.
 */
#include "attentionPlugin.h"
#include "kvInjectionPlugin.h"

#include <cstdio>
#include <cstring>
#include <vector>

using namespace nvinfer1;
using namespace dflash_trt;

// The registry lives in libnvinfer; this check never registers anything.
extern "C" IPluginRegistry* getPluginRegistry() noexcept
{
    return nullptr;
}

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace
{

int gFailures = 0;

void expect(bool ok, char const* what)
{
    if (!ok)
    {
        std::printf("FAILED: %s\n", what);
        ++gFailures;
    }
}

struct Fields
{
    int32_t numLayers = 3, numKvHeads = 4, headDim = 128, layerIdxOffset = 36, tokensPerBlock = 32;
    int32_t typeId = static_cast<int32_t>(DataType::kBF16), cacheFp8 = 1;
    float eps = 1e-6f, attentionScaling = 1.25f;
    std::vector<float> invFreq = std::vector<float>(64);
    std::vector<PluginField> list;
    PluginFieldCollection fc{};

    PluginFieldCollection const* collection()
    {
        list = {
            {"num_layers", &numLayers, PluginFieldType::kINT32, 1},
            {"num_kv_heads", &numKvHeads, PluginFieldType::kINT32, 1},
            {"head_dim", &headDim, PluginFieldType::kINT32, 1},
            {"layer_idx_offset", &layerIdxOffset, PluginFieldType::kINT32, 1},
            {"tokens_per_block", &tokensPerBlock, PluginFieldType::kINT32, 1},
            {"type_id", &typeId, PluginFieldType::kINT32, 1},
            {"cache_fp8", &cacheFp8, PluginFieldType::kINT32, 1},
            {"eps", &eps, PluginFieldType::kFLOAT32, 1},
            {"rope_inv_freq", invFreq.data(), PluginFieldType::kFLOAT32, static_cast<int32_t>(invFreq.size())},
            {"rope_attention_scaling", &attentionScaling, PluginFieldType::kFLOAT32, 1},
        };
        fc.nbFields = static_cast<int32_t>(list.size());
        fc.fields = list.data();
        return &fc;
    }
};

bool sameFields(PluginFieldCollection const* a, PluginFieldCollection const* b)
{
    if (a->nbFields != b->nbFields)
    {
        return false;
    }
    for (int32_t i = 0; i < a->nbFields; ++i)
    {
        PluginField const& x = a->fields[i];
        PluginField const& y = b->fields[i];
        if (std::strcmp(x.name, y.name) != 0 || x.type != y.type || x.length != y.length
            || std::memcmp(x.data, y.data, static_cast<size_t>(x.length) * 4) != 0)
        {
            return false;
        }
    }
    return true;
}

Dims dims(std::initializer_list<int64_t> values)
{
    Dims d{};
    d.nbDims = static_cast<int32_t>(values.size());
    int32_t i = 0;
    for (int64_t v : values)
    {
        d.d[i++] = v;
    }
    return d;
}

std::vector<DynamicPluginTensorDesc> goodDescs(Fields const& f)
{
    std::vector<std::pair<DataType, Dims>> const spec = {
        {DataType::kBF16, dims({-1, int64_t{f.numLayers} * 2 * f.numKvHeads * f.headDim})},
        {DataType::kBF16, dims({f.numLayers, f.headDim})},
        {DataType::kINT32, dims({-1})},
        {DataType::kINT32, dims({-1})},
        {DataType::kINT32, dims({-1})},
        {DataType::kINT32, dims({-1})},
        {DataType::kINT32, dims({1, -1, 2, -1})},
        {DataType::kINT64, dims({1, 2})},
        {DataType::kINT32, dims({40, 2})},
        {DataType::kINT32, dims({-1})},
        {DataType::kFLOAT, dims({1})},
        {DataType::kINT32, dims({-1})},
    };
    std::vector<DynamicPluginTensorDesc> descs(spec.size());
    for (size_t i = 0; i < spec.size(); ++i)
    {
        descs[i].desc.type = spec[i].first;
        descs[i].desc.dims = spec[i].second;
        descs[i].desc.format = TensorFormat::kLINEAR;
    }
    return descs;
}

bool allSupported(IPluginV3OneBuild* build, std::vector<DynamicPluginTensorDesc> const& descs)
{
    for (int32_t pos = 0; pos < static_cast<int32_t>(descs.size()); ++pos)
    {
        if (!build->supportsFormatCombination(pos, descs.data(), static_cast<int32_t>(descs.size()) - 1, 1))
        {
            return false;
        }
    }
    return true;
}


struct AttentionFields
{
    int32_t numHeads = 32, numKvHeads = 8, headDim = 128, layerIdx = 37, tokensPerBlock = 32, maxQueryLen = 16;
    int32_t blockMask = 0, slidingWindow = 2048, windowFromAnchor = 1, maxPositions = 4096;
    int32_t typeId = static_cast<int32_t>(DataType::kBF16), cacheFp8 = 1;
    float qScaling = 1.f;
    std::vector<PluginField> list;
    PluginFieldCollection fc{};

    PluginFieldCollection const* collection()
    {
        list = {
            {"num_heads", &numHeads, PluginFieldType::kINT32, 1},
            {"num_kv_heads", &numKvHeads, PluginFieldType::kINT32, 1},
            {"head_dim", &headDim, PluginFieldType::kINT32, 1},
            {"layer_idx", &layerIdx, PluginFieldType::kINT32, 1},
            {"tokens_per_block", &tokensPerBlock, PluginFieldType::kINT32, 1},
            {"max_query_len", &maxQueryLen, PluginFieldType::kINT32, 1},
            {"block_mask", &blockMask, PluginFieldType::kINT32, 1},
            {"sliding_window", &slidingWindow, PluginFieldType::kINT32, 1},
            {"window_from_anchor", &windowFromAnchor, PluginFieldType::kINT32, 1},
            {"max_positions", &maxPositions, PluginFieldType::kINT32, 1},
            {"type_id", &typeId, PluginFieldType::kINT32, 1},
            {"cache_fp8", &cacheFp8, PluginFieldType::kINT32, 1},
            {"q_scaling", &qScaling, PluginFieldType::kFLOAT32, 1},
        };
        fc.nbFields = static_cast<int32_t>(list.size());
        fc.fields = list.data();
        return &fc;
    }
};

//! The inputs and output of a plugin made from `f`: with block_mask 2 the tree's position offsets and packed mask
//! sit after host_past_key_value_lengths, before the FP8 scales.
std::vector<DynamicPluginTensorDesc> attentionDescs(AttentionFields const& f)
{
    int64_t const width = int64_t{f.numHeads + 2 * f.numKvHeads} * f.headDim;
    std::vector<std::pair<DataType, Dims>> spec = {
        {DataType::kBF16, dims({-1, width})},
        {DataType::kINT32, dims({-1})},
        {DataType::kINT32, dims({-1})},
        {DataType::kFLOAT, dims({1, int64_t{f.maxPositions} * f.headDim})},
        {DataType::kINT32, dims({1, -1, 2, -1})},
        {DataType::kINT64, dims({1, 2})},
        {DataType::kINT32, dims({40, 2})},
        {DataType::kINT32, dims({-1})},
        {DataType::kFLOAT, dims({1})},
        {DataType::kFLOAT, dims({1})},
        {DataType::kBF16, dims({-1, int64_t{f.numHeads} * f.headDim})},
    };
    if (f.blockMask == 2)
    {
        std::pair<DataType, Dims> const offsets{DataType::kINT32, dims({-1, f.maxQueryLen})};
        std::pair<DataType, Dims> const mask{DataType::kINT32, dims({-1, (f.maxQueryLen + 31) / 32})};
        spec.insert(spec.begin() + 8, {offsets, mask});
    }
    std::vector<DynamicPluginTensorDesc> descs(spec.size());
    for (size_t i = 0; i < spec.size(); ++i)
    {
        descs[i].desc.type = spec[i].first;
        descs[i].desc.dims = spec[i].second;
        descs[i].desc.format = TensorFormat::kLINEAR;
        descs[i].max = spec[i].second;
    }
    descs[kQkv].max.d[0] = 1024;
    return descs;
}

void checkAttention(IPluginCreatorV3One* creator)
{
    expect(std::strcmp(creator->getPluginName(), "DFlashAttention") == 0, "attention creator name");
    expect(std::strcmp(creator->getPluginNamespace(), "dflash_trt") == 0, "attention creator namespace");
    expect(creator->getFieldNames()->nbFields == 13, "thirteen attention creation fields");
    AttentionFields fields;
    IPluginV3* plugin = creator->createPlugin("attention", fields.collection(), TensorRTPhase::kBUILD);
    expect(plugin != nullptr, "attention plugin created");
    if (plugin == nullptr)
    {
        return;
    }
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* serialized = runtime->getFieldsToSerialize();
    expect(sameFields(serialized, fields.collection()), "attention fields serialize as created");
    IPluginV3* restored = creator->createPlugin("attention", serialized, TensorRTPhase::kRUNTIME);
    expect(restored != nullptr, "attention plugin restored from its serialized fields");
    if (restored != nullptr)
    {
        auto* again = static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        expect(sameFields(again->getFieldsToSerialize(), fields.collection()), "attention round trip is lossless");
        delete restored;
    }

    std::vector<DynamicPluginTensorDesc> descs = attentionDescs(fields);
    expect(allSupported(build, descs), "attention dtypes accepted");
    DataType inTypes[10];
    for (int32_t i = 0; i < 10; ++i)
    {
        inTypes[i] = descs[i].desc.type;
    }
    DataType outType{};
    expect(build->getOutputDataTypes(&outType, 1, inTypes, 10) == 0 && outType == DataType::kBF16,
        "attention output takes the input type");
    expect(build->configurePlugin(descs.data(), 10, &descs[10], 1) == 0, "good attention shapes configure");
    expect(build->getWorkspaceSize(descs.data(), 10, &descs[10], 1)
            >= static_cast<size_t>(attentionWorkspaceBound(1024, fields.numHeads, fields.headDim, 2)),
        "workspace holds the rotated queries and the split-K partials");

    auto rejects = [&](char const* what, auto mutate)
    {
        std::vector<DynamicPluginTensorDesc> bad = attentionDescs(fields);
        mutate(bad);
        expect(!allSupported(build, bad), what);
    };
    rejects("fp16 qkv refused by a bf16 plugin", [](auto& d) { d[kQkv].desc.type = DataType::kHALF; });
    rejects("int32 pool pointers refused", [](auto& d) { d[kAttnPoolPointers].desc.type = DataType::kINT32; });
    rejects("fp16 rotary table refused", [](auto& d) { d[kRotaryCosSin].desc.type = DataType::kHALF; });
    rejects("output must take the input type", [](auto& d) { d[10].desc.type = DataType::kFLOAT; });
    std::vector<DynamicPluginTensorDesc> wrongWidth = attentionDescs(fields);
    wrongWidth[kQkv].desc.dims = dims({-1, 100});
    expect(build->configurePlugin(wrongWidth.data(), 10, &wrongWidth[10], 1) != 0, "wrong qkv width refused");
    std::vector<DynamicPluginTensorDesc> shortTable = attentionDescs(fields);
    shortTable[kRotaryCosSin].desc.dims = dims({1, 100});
    expect(build->configurePlugin(shortTable.data(), 10, &shortTable[10], 1) != 0, "short rotary table refused");
    std::vector<DynamicPluginTensorDesc> shortMapping = attentionDescs(fields);
    shortMapping[kAttnPoolMapping].desc.dims = dims({37, 2});
    expect(build->configurePlugin(shortMapping.data(), 10, &shortMapping[10], 1) != 0,
        "pool mapping without the layer refused");
    expect(build->configurePlugin(descs.data(), 8, &descs[10], 1) != 0, "missing FP8 scale inputs refused");
    delete plugin;

    auto refused = [&](char const* what, auto mutate)
    {
        AttentionFields f = fields;
        mutate(f);
        IPluginV3* p = creator->createPlugin("attention", f.collection(), TensorRTPhase::kBUILD);
        expect(p == nullptr, what);
        delete p;
    };
    refused("head_dim 96 refused", [](AttentionFields& f) { f.headDim = 96; });
    refused("head_dim 16 refused", [](AttentionFields& f) { f.headDim = 16; });
    refused("heads not a multiple of kv heads refused", [](AttentionFields& f) { f.numHeads = 30; });
    refused("tokens_per_block 24 refused", [](AttentionFields& f) { f.tokensPerBlock = 24; });
    refused("block_mask 3 refused", [](AttentionFields& f) { f.blockMask = 3; });
    refused("a tree mask with a window refused", [](AttentionFields& f) { f.blockMask = 2; });
    refused("negative window refused", [](AttentionFields& f) { f.slidingWindow = -1; });
    refused("window_from_anchor 2 refused", [](AttentionFields& f) { f.windowFromAnchor = 2; });
    refused("fp32 type_id refused", [](AttentionFields& f) { f.typeId = static_cast<int32_t>(DataType::kFLOAT); });
}

//! A draft tree's verification (block_mask 2): the runtime's position offsets and packed mask are two more int32
//! inputs before the FP8 scales; their shapes are checked against max_query_len and the tokens.
void checkAttentionTree(IPluginCreatorV3One* creator)
{
    AttentionFields fields;
    fields.blockMask = 2;
    fields.slidingWindow = 0;
    fields.windowFromAnchor = 0;
    fields.maxQueryLen = 41;
    IPluginV3* plugin = creator->createPlugin("attention", fields.collection(), TensorRTPhase::kBUILD);
    expect(plugin != nullptr, "tree attention plugin created");
    if (plugin == nullptr)
    {
        return;
    }
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    IPluginV3* restored = creator->createPlugin("attention", runtime->getFieldsToSerialize(), TensorRTPhase::kRUNTIME);
    expect(restored != nullptr && sameFields(static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(
                                                 PluginCapabilityType::kRUNTIME))
                                                 ->getFieldsToSerialize(),
                                      fields.collection()),
        "tree attention round trip is lossless");
    delete restored;
    std::vector<DynamicPluginTensorDesc> descs = attentionDescs(fields);
    int32_t const nb = static_cast<int32_t>(descs.size()) - 1;
    expect(nb == 12, "tree attention takes twelve inputs with an FP8 cache");
    expect(allSupported(build, descs), "tree attention dtypes accepted");
    expect(build->configurePlugin(descs.data(), nb, &descs[nb], 1) == 0, "good tree shapes configure");
    std::vector<DynamicPluginTensorDesc> floatMask = attentionDescs(fields);
    floatMask[9].desc.type = DataType::kFLOAT;
    expect(!allSupported(build, floatMask), "a float packed mask refused");
    std::vector<DynamicPluginTensorDesc> intScale = attentionDescs(fields);
    intScale[10].desc.type = DataType::kINT32;
    expect(!allSupported(build, intScale), "an int32 FP8 scale refused");
    std::vector<DynamicPluginTensorDesc> oneWord = attentionDescs(fields);
    oneWord[9].desc.dims = dims({-1, 1});
    expect(build->configurePlugin(oneWord.data(), nb, &oneWord[nb], 1) != 0, "mask rows under max_query_len bits refused");
    std::vector<DynamicPluginTensorDesc> fewRows = attentionDescs(fields);
    fewRows[kQkv].desc.dims = dims({64, fewRows[kQkv].desc.dims.d[1]});
    fewRows[9].desc.dims = dims({63, 2});
    expect(build->configurePlugin(fewRows.data(), nb, &fewRows[nb], 1) != 0, "fewer mask rows than tokens refused");
    std::vector<DynamicPluginTensorDesc> flatOffsets = attentionDescs(fields);
    flatOffsets[8].desc.dims = dims({-1});
    expect(build->configurePlugin(flatOffsets.data(), nb, &flatOffsets[nb], 1) != 0, "1-D position offsets refused");
    AttentionFields chain = fields;
    chain.blockMask = 0;
    std::vector<DynamicPluginTensorDesc> chainDescs = attentionDescs(chain);
    expect(build->configurePlugin(chainDescs.data(), 10, &chainDescs[10], 1) != 0, "a tree without its inputs refused");
    delete plugin;
}

} // namespace

namespace
{

void checkKvInjection(IPluginCreatorV3One* creator)
{
    expect(std::strcmp(creator->getPluginName(), "DFlashKVInjection") == 0, "creator name");
    expect(std::strcmp(creator->getPluginNamespace(), "dflash_trt") == 0, "creator namespace");
    expect(creator->getFieldNames()->nbFields == 10, "ten creation fields");

    Fields fields;
    for (size_t i = 0; i < fields.invFreq.size(); ++i)
    {
        fields.invFreq[i] = 1.0f / static_cast<float>(i + 1);
    }
    IPluginV3* plugin = creator->createPlugin("kv", fields.collection(), TensorRTPhase::kBUILD);
    expect(plugin != nullptr, "plugin created");
    if (plugin == nullptr)
    {
        return;
    }
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    expect(std::strcmp(core->getPluginVersion(), "1") == 0, "plugin version");

    PluginFieldCollection const* serialized = runtime->getFieldsToSerialize();
    expect(sameFields(serialized, fields.collection()), "serialized fields equal creation fields");
    IPluginV3* restored = creator->createPlugin("kv", serialized, TensorRTPhase::kRUNTIME);
    expect(restored != nullptr, "plugin restored from its serialized fields");
    if (restored != nullptr)
    {
        auto* restoredRuntime
            = static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        expect(sameFields(restoredRuntime->getFieldsToSerialize(), fields.collection()), "round trip is lossless");
        delete restored;
    }

    std::vector<DynamicPluginTensorDesc> descs = goodDescs(fields);
    expect(allSupported(build, descs), "documented dtypes accepted");
    DataType outType{};
    DataType inTypes[11];
    for (int32_t i = 0; i < 11; ++i)
    {
        inTypes[i] = descs[i].desc.type;
    }
    expect(build->getNbOutputs() == 1 && build->getOutputDataTypes(&outType, 1, inTypes, 11) == 0
            && outType == DataType::kINT32,
        "output takes the passthrough type");
    expect(build->configurePlugin(descs.data(), 11, &descs[11], 1) == 0, "good shapes configure");

    auto rejects = [&](char const* what, auto mutate)
    {
        std::vector<DynamicPluginTensorDesc> bad = goodDescs(fields);
        mutate(bad);
        expect(!allSupported(build, bad), what);
    };
    rejects("fp16 ctx_kv refused by a bf16 plugin", [](auto& d) { d[kCtxKv].desc.type = DataType::kHALF; });
    rejects("int32 pool pointers refused", [](auto& d) { d[kPoolPointers].desc.type = DataType::kINT32; });
    rejects("int64 positions refused", [](auto& d) { d[kPositions].desc.type = DataType::kINT64; });
    rejects("int64 cache positions refused", [](auto& d) { d[kCachePositions].desc.type = DataType::kINT64; });
    rejects("output type must follow passthrough", [](auto& d) { d[11].desc.type = DataType::kFLOAT; });
    rejects("non-linear format refused", [](auto& d) { d[kValid].desc.format = TensorFormat::kCHW32; });

    std::vector<DynamicPluginTensorDesc> wrongWidth = goodDescs(fields);
    wrongWidth[kCtxKv].desc.dims = dims({-1, 100});
    expect(build->configurePlugin(wrongWidth.data(), 11, &wrongWidth[11], 1) != 0, "wrong ctx_kv width refused");
    std::vector<DynamicPluginTensorDesc> shortMapping = goodDescs(fields);
    shortMapping[kPoolMapping].desc.dims = dims({38, 2});
    expect(build->configurePlugin(shortMapping.data(), 11, &shortMapping[11], 1) != 0,
        "pool mapping without the draft layers refused");
    expect(build->configurePlugin(descs.data(), 10, &descs[11], 1) != 0, "missing FP8 scale input refused");
    delete plugin;

    auto refused = [&](char const* what, auto mutate)
    {
        Fields f = fields;
        mutate(f);
        IPluginV3* p = creator->createPlugin("kv", f.collection(), TensorRTPhase::kBUILD);
        expect(p == nullptr, what);
        delete p;
    };
    refused("head_dim 80 refused", [](Fields& f) { f.headDim = 80, f.invFreq.resize(40); });
    refused("tokens_per_block 24 refused", [](Fields& f) { f.tokensPerBlock = 24; });
    refused("short rope_inv_freq refused", [](Fields& f) { f.invFreq.resize(10); });
    refused("fp32 type_id refused", [](Fields& f) { f.typeId = static_cast<int32_t>(DataType::kFLOAT); });
    refused("zero layers refused", [](Fields& f) { f.numLayers = 0; });
}

} // namespace

int main()
{
    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    expect(nbCreators == 2, "two creators exported");
    checkKvInjection(static_cast<IPluginCreatorV3One*>(creators[0]));
    checkAttention(static_cast<IPluginCreatorV3One*>(creators[1]));
    checkAttentionTree(static_cast<IPluginCreatorV3One*>(creators[1]));
    std::printf(gFailures == 0 ? "OK\n" : "%d checks failed\n", gFailures);
    return gFailures == 0 ? 0 : 1;
}
