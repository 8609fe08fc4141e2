/*
 * Entry points of libdflash_trt_plugins.so:
 * - initDflashTrtPlugins(logger, namespace): what dflash_trt/trtllm/plugin.py calls after dlopen (TensorRT-LLM style);
 * - setLoggerFinder / getCreators: TensorRT's plugin-library interface (IPluginRegistry::loadLibrary, trtexec
 *   --dynamicPlugins);
 * - with DFLASH_TRT_LOAD_PLUGINS=1 the creators register themselves when the library loads, so LD_PRELOAD is
 *   enough for processes that never call initDflashTrtPlugins (the Triton tensorrtllm backend).
 */
#include "attentionPlugin.h"
#include "kvInjectionPlugin.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

using namespace nvinfer1;

namespace dflash_trt
{
namespace
{

ILogger* gLogger = nullptr;
ILoggerFinder* gLoggerFinder = nullptr;
std::mutex gMutex;

KVInjectionPluginCreator& kvInjectionCreator()
{
    static KVInjectionPluginCreator creator;
    return creator;
}

AttentionPluginCreator& attentionCreator()
{
    static AttentionPluginCreator creator;
    return creator;
}

//! Register one creator under `ns` unless the registry already holds it.
template <class Creator>
bool registerCreator(IPluginRegistry& registry, Creator& creator, char const* name, char const* version, char const* ns)
{
    if (registry.getCreator(name, version, ns) != nullptr)
    {
        return true;
    }
    creator.setPluginNamespace(ns);
    return registry.registerCreator(creator, ns);
}

} // namespace

void logError(std::string const& message)
{
    ILogger* logger = gLogger;
    if (logger == nullptr && gLoggerFinder != nullptr)
    {
        logger = gLoggerFinder->findLogger();
    }
    if (logger != nullptr)
    {
        logger->log(ILogger::Severity::kERROR, message.c_str());
    }
    else
    {
        std::fprintf(stderr, "[dflash_trt] %s\n", message.c_str());
    }
}

} // namespace dflash_trt

extern "C"
{

//! Register every creator under `libNamespace` (nullptr: "dflash_trt"); true when registered (now or before).
__attribute__((visibility("default"))) bool initDflashTrtPlugins(void* logger, char const* libNamespace)
{
    using namespace dflash_trt;
    std::lock_guard<std::mutex> lock(gMutex);
    if (logger != nullptr)
    {
        gLogger = static_cast<ILogger*>(logger);
    }
    char const* ns = libNamespace != nullptr ? libNamespace : kDefaultPluginNamespace;
    IPluginRegistry* registry = getPluginRegistry();
    if (registry == nullptr)
    {
        return false;
    }
    bool const kvInjection
        = registerCreator(*registry, kvInjectionCreator(), kKvInjectionPluginName, kKvInjectionPluginVersion, ns);
    bool const attention
        = registerCreator(*registry, attentionCreator(), kAttentionPluginName, kAttentionPluginVersion, ns);
    return kvInjection && attention;
}

__attribute__((visibility("default"))) void setLoggerFinder(ILoggerFinder* finder)
{
    dflash_trt::gLoggerFinder = finder;
}

__attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static IPluginCreatorInterface* const creators[]
        = {&dflash_trt::kvInjectionCreator(), &dflash_trt::attentionCreator()};
    nbCreators = 2;
    return creators;
}

} // extern "C"

namespace
{

__attribute__((constructor)) void registerOnLoad()
{
    char const* flag = std::getenv("DFLASH_TRT_LOAD_PLUGINS");
    if (flag != nullptr && std::strcmp(flag, "1") == 0)
    {
        initDflashTrtPlugins(nullptr, nullptr);
    }
}

} // namespace
