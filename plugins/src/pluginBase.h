/*
 * What the two IPluginV3 classes of libdflash_trt_plugins.so and their creators do alike, written once: the three
 * capability interfaces, identity (name, version, namespace), clone and attachToContext (the plugins hold no
 * per-context state), one output, and the field collections TensorRT reads. Each plugin keeps what is its own:
 * shapes, formats, workspace, enqueue and its fields. `Derived` names itself through `kPluginName` /
 * `kPluginVersion` and is constructible from (Config, namespace).
 */
#pragma once

#include "pluginUtils.h"

#include <NvInferRuntime.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace dflash_trt
{

//! `collection` pointing at `fields` (TensorRT reads both until the next call).
inline nvinfer1::PluginFieldCollection const* publishFields(
    std::vector<nvinfer1::PluginField> const& fields, nvinfer1::PluginFieldCollection& collection)
{
    collection.nbFields = static_cast<int32_t>(fields.size());
    collection.fields = fields.data();
    return &collection;
}

template <typename Derived, typename Config>
class PluginV3Base : public nvinfer1::IPluginV3,
                     public nvinfer1::IPluginV3OneCore,
                     public nvinfer1::IPluginV3OneBuild,
                     public nvinfer1::IPluginV3OneRuntime
{
public:
    PluginV3Base(Config config, std::string pluginNamespace)
        : mConfig(std::move(config))
        , mNamespace(std::move(pluginNamespace))
    {
    }

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    nvinfer1::IPluginV3* clone() noexcept override
    {
        try
        {
            return new Derived(mConfig, mNamespace);
        }
        catch (std::exception const& e)
        {
            logError(e.what());
        }
        return nullptr;
    }

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override
    {
        return Derived::kPluginName;
    }

    char const* getPluginVersion() const noexcept override
    {
        return Derived::kPluginVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return mNamespace.c_str();
    }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override
    {
        return 1;
    }

    // IPluginV3OneRuntime
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext*) noexcept override
    {
        return clone();
    }

protected:
    Config mConfig;
    std::string mNamespace;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

template <typename Plugin>
class PluginCreatorBase : public nvinfer1::IPluginCreatorV3One
{
public:
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return publishFields(mFieldNames, mFieldNameCollection);
    }

    char const* getPluginName() const noexcept override
    {
        return Plugin::kPluginName;
    }

    char const* getPluginVersion() const noexcept override
    {
        return Plugin::kPluginVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return mNamespace.c_str();
    }

    void setPluginNamespace(char const* pluginNamespace)
    {
        mNamespace = pluginNamespace != nullptr ? pluginNamespace : "";
    }

protected:
    std::string mNamespace{kDefaultPluginNamespace};
    std::vector<nvinfer1::PluginField> mFieldNames;
    nvinfer1::PluginFieldCollection mFieldNameCollection{};
};

} // namespace dflash_trt
