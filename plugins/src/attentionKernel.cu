/*
 * DFlashAttention on the GPU: the device backend of attentionCta.h (cp.async, ldmatrix, mma.sync m16n8k16 with
 * float32 accumulators, warp shuffles) and the three kernels around it. sm_80 instructions only, so one source
 * serves Hopper (sm_90) and Blackwell (sm_100, sm_103).
 */
#include "dflash_trt/attentionKernel.h"

namespace dflash_trt
{
namespace
{

constexpr int32_t kPrepareThreads = 256;
constexpr int32_t kCombineWarps = 4;

//! Source of a zero-filling cp.async (no byte of it is read).
__device__ uint4 gZeroChunk;

struct DeviceBackend
{
    static constexpr int32_t kWarps = 1;
    static constexpr int32_t kLanes = 1;

    DFLASH_HD int32_t warpIndex(int32_t) const
    {
#if defined(__CUDA_ARCH__)
        return static_cast<int32_t>(threadIdx.x) / 32;
#else
        return 0;
#endif
    }

    DFLASH_HD int32_t laneIndex(int32_t) const
    {
#if defined(__CUDA_ARCH__)
        return static_cast<int32_t>(threadIdx.x) % 32;
#else
        return 0;
#endif
    }

    template <class F>
    DFLASH_HD void forThreads(F f) const
    {
#if defined(__CUDA_ARCH__)
        f(static_cast<int32_t>(threadIdx.x));
#else
        (void) f;
#endif
    }

    DFLASH_HD void sync() const
    {
#if defined(__CUDA_ARCH__)
        __syncthreads();
#endif
    }

    DFLASH_HD void copy16(void* dst, void const* src, bool valid) const
    {
#if defined(__CUDA_ARCH__)
        auto const shared = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
        void const* from = valid ? src : static_cast<void const*>(&gZeroChunk);
        int32_t const bytes = valid ? 16 : 0;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(from), "r"(bytes));
#else
        (void) dst, (void) src, (void) valid;
#endif
    }

    DFLASH_HD void commit() const
    {
#if defined(__CUDA_ARCH__)
        asm volatile("cp.async.commit_group;\n" ::);
#endif
    }

    DFLASH_HD void waitAllButOne() const
    {
#if defined(__CUDA_ARCH__)
        asm volatile("cp.async.wait_group 1;\n" ::);
#endif
    }

    DFLASH_HD void waitAll() const
    {
#if defined(__CUDA_ARCH__)
        asm volatile("cp.async.wait_group 0;\n" ::);
#endif
    }

    template <typename T>
    DFLASH_HD void ldmatrix(
        Operand op, uint32_t (&r)[1][4], T const* tile, int32_t row0, int32_t col0, int32_t headDim) const
    {
#if defined(__CUDA_ARCH__)
        int32_t const lane = laneIndex(0);
        T const* at = tile + tileElementOffset(row0 + operandRow(op, lane), col0 + operandCol(op, lane), headDim);
        auto const address = static_cast<uint32_t>(__cvta_generic_to_shared(at));
        if (op == Operand::kV)
        {
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(r[0][0]), "=r"(r[0][1]), "=r"(r[0][2]), "=r"(r[0][3])
                         : "r"(address));
        }
        else
        {
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(r[0][0]), "=r"(r[0][1]), "=r"(r[0][2]), "=r"(r[0][3])
                         : "r"(address));
        }
#else
        (void) op, (void) r, (void) tile, (void) row0, (void) col0, (void) headDim;
#endif
    }

    template <typename T, int32_t N>
    DFLASH_HD void mma(float (&acc)[1][N][4], int32_t tileIndex, uint32_t const (&a)[1][4],
        uint32_t const (&b)[1][4], int32_t first) const
    {
#if defined(__CUDA_ARCH__)
        float* d = acc[0][tileIndex];
        if constexpr (std::is_same_v<T, __nv_bfloat16>)
        {
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                "{%8, %9}, {%0, %1, %2, %3};\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][first]), "r"(b[0][first + 1]));
        }
        else
        {
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                "{%8, %9}, {%0, %1, %2, %3};\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][first]), "r"(b[0][first + 1]));
        }
#else
        (void) acc, (void) tileIndex, (void) a, (void) b, (void) first;
#endif
    }

    DFLASH_HD void quadMax(float (&v)[1]) const
    {
#if defined(__CUDA_ARCH__)
        v[0] = fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], 1));
        v[0] = fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], 2));
#else
        (void) v;
#endif
    }

    DFLASH_HD void quadSum(float (&v)[1]) const
    {
#if defined(__CUDA_ARCH__)
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], 2);
#else
        (void) v;
#endif
    }
};

//! The first packed row of `request`: the sum of the earlier requests' lengths, reduced over one warp (every lane
//! of the calling warp must call it).
__device__ int32_t rowStartOf(int32_t const* lengths, int32_t request)
{
    int32_t const lane = static_cast<int32_t>(threadIdx.x) % 32;
    int32_t sum = 0;
    for (int32_t i = lane; i < request; i += 32)
    {
        sum += lengths[i];
    }
    for (int32_t offset = 16; offset > 0; offset /= 2)
    {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    return sum;
}

//! grid (chunks of threads, requests): one thread per (token, head unit, 8-channel chunk).
template <typename T, typename Cache>
__global__ void __launch_bounds__(kPrepareThreads) prepareKernel(AttentionLaunch const p)
{
    int32_t const request = static_cast<int32_t>(blockIdx.y);
    int32_t const rowStart = rowStartOf(p.genLens, request);
    RequestRows const req = requestRows(p, request, rowStart);
    int32_t const chunks = p.addressing.headDim / 16;
    int32_t const units = p.numHeads + p.addressing.numKvHeads;
    int32_t const index = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
    int32_t const token = index / (units * chunks);
    if (token < p.maxQueryLen)
    {
        prepareChunk<T, Cache>(p, req, request, token, (index / chunks) % units, index % chunks);
    }
}

//! grid (splits, kv heads x row tiles, requests), 128 threads: one AttentionCta.
template <typename T, typename Cache, int32_t D>
__global__ void __launch_bounds__(kCtaRows * 2) attendKernel(AttentionLaunch const p)
{
    extern __shared__ __align__(128) uint8_t shared[];
    auto& smem = *reinterpret_cast<AttentionSmem<T, D>*>(shared);
    Fp8Staging<D>* staging = sizeof(Cache) == 1 ? reinterpret_cast<Fp8Staging<D>*>(shared + sizeof(smem)) : nullptr;
    int32_t const request = static_cast<int32_t>(blockIdx.z);
    int32_t const rowTiles = rowTilesFor(p.maxQueryLen, groupSize(p));
    int32_t const rowStart = rowStartOf(p.genLens, request);
    DeviceBackend const backend;
    AttentionCta<DeviceBackend, T, Cache, D> cta(backend, p, smem, staging, request, rowStart,
        static_cast<int32_t>(blockIdx.y) / rowTiles, static_cast<int32_t>(blockIdx.y) % rowTiles,
        static_cast<int32_t>(blockIdx.x));
    if (cta.active())
    {
        cta.run();
    }
}

//! grid (requests, max query length), kCombineWarps warps: a warp per (token, head), lanes over channels.
template <typename T, int32_t D>
__global__ void __launch_bounds__(kCombineWarps * 32) combineKernel(AttentionLaunch const p)
{
    int32_t const request = static_cast<int32_t>(blockIdx.x);
    int32_t const token = static_cast<int32_t>(blockIdx.y);
    int32_t const rowStart = rowStartOf(p.genLens, request);
    RequestRows const req = requestRows(p, request, rowStart);
    if (token >= req.queries)
    {
        return;
    }
    int32_t const lane = static_cast<int32_t>(threadIdx.x) % 32;
    int32_t constexpr perLane = D / 32;
    for (int32_t head = static_cast<int32_t>(threadIdx.x) / 32; head < p.numHeads; head += kCombineWarps)
    {
        int64_t const headRow = static_cast<int64_t>(rowStart + token) * p.numHeads + head;
        combineChannels<T>(p, req, headRow, D, lane * perLane, (lane + 1) * perLane, p.scaleQuantOrig != nullptr);
    }
}

template <typename T, typename Cache, int32_t D>
cudaError_t launchTyped(AttentionLaunch p, int32_t maxKeys, int32_t multiProcessorCount, cudaStream_t stream)
{
    int32_t const group = groupSize(p);
    int32_t const tile = keysPerTile(D);
    int32_t const rowTiles = rowTilesFor(p.maxQueryLen, group);
    int64_t const baseCtas = static_cast<int64_t>(p.numRequests) * p.addressing.numKvHeads * rowTiles;
    p.splits = chooseSplits(baseCtas, maxKeys, tile, 2 * static_cast<int64_t>(multiProcessorCount),
        static_cast<int64_t>(p.numTokens) * p.numHeads);
    p.keysPerSplit = keysPerSplitFor(maxKeys, p.splits, tile);

    int32_t const units = p.numHeads + p.addressing.numKvHeads;
    int64_t const prepareThreads = static_cast<int64_t>(p.maxQueryLen) * units * (D / 16);
    dim3 const prepareGrid(static_cast<unsigned>((prepareThreads + kPrepareThreads - 1) / kPrepareThreads),
        static_cast<unsigned>(p.numRequests));
    prepareKernel<T, Cache><<<prepareGrid, kPrepareThreads, 0, stream>>>(p);

    size_t const shared = sizeof(AttentionSmem<T, D>) + (sizeof(Cache) == 1 ? sizeof(Fp8Staging<D>) : 0);
    cudaError_t status = cudaFuncSetAttribute(
        attendKernel<T, Cache, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (status != cudaSuccess)
    {
        return status;
    }
    dim3 const attendGrid(static_cast<unsigned>(p.splits),
        static_cast<unsigned>(p.addressing.numKvHeads * rowTiles), static_cast<unsigned>(p.numRequests));
    attendKernel<T, Cache, D><<<attendGrid, kCtaRows * 2, shared, stream>>>(p);
    if (p.splits > 1)
    {
        dim3 const combineGrid(static_cast<unsigned>(p.numRequests), static_cast<unsigned>(p.maxQueryLen));
        combineKernel<T, D><<<combineGrid, kCombineWarps * 32, 0, stream>>>(p);
    }
    return cudaGetLastError();
}

template <typename T, typename Cache>
cudaError_t launchForHeadDim(AttentionLaunch const& p, int32_t maxKeys, int32_t sms, cudaStream_t stream)
{
    switch (p.addressing.headDim)
    {
    case 32: return launchTyped<T, Cache, 32>(p, maxKeys, sms, stream);
    case 64: return launchTyped<T, Cache, 64>(p, maxKeys, sms, stream);
    case 128: return launchTyped<T, Cache, 128>(p, maxKeys, sms, stream);
    case 256: return launchTyped<T, Cache, 256>(p, maxKeys, sms, stream);
    default: return cudaErrorInvalidValue;
    }
}

template <typename T>
cudaError_t launchForCache(AttentionLaunch const& p, CacheType cache, int32_t maxKeys, int32_t sms, cudaStream_t s)
{
    switch (cache)
    {
    case CacheType::kHALF:
        return std::is_same_v<T, __half> ? launchForHeadDim<T, T>(p, maxKeys, sms, s) : cudaErrorInvalidValue;
    case CacheType::kBF16:
        return std::is_same_v<T, __nv_bfloat16> ? launchForHeadDim<T, T>(p, maxKeys, sms, s) : cudaErrorInvalidValue;
    case CacheType::kFP8_E4M3: return launchForHeadDim<T, __nv_fp8_e4m3>(p, maxKeys, sms, s);
    }
    return cudaErrorInvalidValue;
}

} // namespace

cudaError_t launchDflashAttention(AttentionLaunch params, InputType input, CacheType cache, int32_t maxKeys,
    int32_t multiProcessorCount, cudaStream_t stream)
{
    if (attentionLaunchProblem(params, cache == CacheType::kFP8_E4M3) != nullptr)
    {
        return cudaErrorInvalidValue;
    }
    if (params.numRequests <= 0 || params.numTokens <= 0)
    {
        return cudaSuccess;
    }
    switch (input)
    {
    case InputType::kHALF: return launchForCache<__half>(params, cache, maxKeys, multiProcessorCount, stream);
    case InputType::kBF16: return launchForCache<__nv_bfloat16>(params, cache, maxKeys, multiProcessorCount, stream);
    }
    return cudaErrorInvalidValue;
}

} // namespace dflash_trt
