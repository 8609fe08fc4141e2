/*
 * Small helpers both IPluginV3 classes of libdflash_trt_plugins.so use: tensor volumes and element sizes, build-time
 * shape checks that let unknown (-1) dims pass, and the library's error log.
 */
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

namespace dflash_trt
{

char const* const kDefaultPluginNamespace = "dflash_trt";

inline int64_t volume(nvinfer1::Dims const& dims)
{
    int64_t n = 1;
    for (int32_t i = 0; i < dims.nbDims; ++i)
    {
        n *= dims.d[i];
    }
    return n;
}

//! Bytes of one element of the types the plugins take (0 for others).
inline size_t elementSize(nvinfer1::DataType type)
{
    switch (type)
    {
    case nvinfer1::DataType::kFLOAT:
    case nvinfer1::DataType::kINT32: return 4;
    case nvinfer1::DataType::kHALF:
    case nvinfer1::DataType::kBF16: return 2;
    case nvinfer1::DataType::kINT64: return 8;
    default: return 0;
    }
}

//! A dim known at build time must equal `expected`; -1 (known only at run time) passes.
inline bool knownOrEqual(int64_t dim, int64_t expected)
{
    return dim < 0 || dim == expected;
}

//! Report through the logger handed to initDflashTrtPlugins / setLoggerFinder, else stderr.
void logError(std::string const& message);

} // namespace dflash_trt
