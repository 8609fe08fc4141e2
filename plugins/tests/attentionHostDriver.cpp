/*
 * CPU driver of the DFlashAttention kernels: the prepare / attend / combine code of attentionCta.h run over host
 * buffers, with a backend that executes each warp instruction (ldmatrix, mma.sync m16n8k16, quad shuffles,
 * cp.async) on all 32 lanes as the PTX ISA defines it. Exported with C linkage for tests/engine/test_attention_kernel_host.py.
 * Build: g++ -std=c++17 -shared -fPIC -I plugins/include -I <cuda>/include.
 */
#include "dflash_trt/attentionCta.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

using namespace dflash_trt;

namespace
{

struct HostBackend
{
    static constexpr int32_t kWarps = kCtaWarps;
    static constexpr int32_t kLanes = 32;

    int32_t warpIndex(int32_t w) const
    {
        return w;
    }

    int32_t laneIndex(int32_t l) const
    {
        return l;
    }

    template <class F>
    void forThreads(F f) const
    {
        for (int32_t thread = 0; thread < kCtaWarps * 32; ++thread)
        {
            f(thread);
        }
    }

    void sync() const {}

    void copy16(void* dst, void const* src, bool valid) const
    {
        if (valid)
        {
            std::memcpy(dst, src, 16);
        }
        else
        {
            std::memset(dst, 0, 16);
        }
    }

    void commit() const {}

    void waitAllButOne() const {}

    void waitAll() const {}

    //! ldmatrix.x4: lane l addresses row l % 8 of matrix l / 8; register m of lane l receives the pair at
    //! (row l / 4, columns 2(l % 4), +1) of matrix m, or with .trans (rows 2(l % 4), +1, column l / 4).
    template <typename T>
    void ldmatrix(Operand op, uint32_t (&r)[kLanes][4], T const* tile, int32_t row0, int32_t col0, int32_t headDim) const
    {
        T const* rowAddress[kLanes];
        for (int32_t l = 0; l < kLanes; ++l)
        {
            rowAddress[l] = tile + tileElementOffset(row0 + operandRow(op, l), col0 + operandCol(op, l), headDim);
        }
        bool const trans = op == Operand::kV;
        for (int32_t l = 0; l < kLanes; ++l)
        {
            for (int32_t m = 0; m < 4; ++m)
            {
                T e0, e1;
                if (trans)
                {
                    e0 = rowAddress[8 * m + 2 * (l % 4)][l / 4];
                    e1 = rowAddress[8 * m + 2 * (l % 4) + 1][l / 4];
                }
                else
                {
                    e0 = rowAddress[8 * m + l / 4][2 * (l % 4)];
                    e1 = rowAddress[8 * m + l / 4][2 * (l % 4) + 1];
                }
                r[l][m] = bitsOf(e0) | (bitsOf(e1) << 16);
            }
        }
    }

    //! mma.sync.m16n8k16: D = A B + C over the whole warp, operands scattered over the lanes per the PTX layouts.
    template <typename T, int32_t N>
    void mma(float (&acc)[kLanes][N][4], int32_t tileIndex, uint32_t const (&a)[kLanes][4],
        uint32_t const (&b)[kLanes][4], int32_t first) const
    {
        float matA[16][16];
        float matB[16][8];
        for (int32_t l = 0; l < kLanes; ++l)
        {
            for (int32_t e = 0; e < 2; ++e)
            {
                for (int32_t reg = 0; reg < 4; ++reg)
                {
                    matA[fragARow(l, reg)][fragACol(l, reg, e)] = toFloat(fromBits<T>(a[l][reg] >> (16 * e)));
                }
                for (int32_t reg = 0; reg < 2; ++reg)
                {
                    matB[fragBK(l, reg, e)][fragBN(l)] = toFloat(fromBits<T>(b[l][first + reg] >> (16 * e)));
                }
            }
        }
        for (int32_t l = 0; l < kLanes; ++l)
        {
            for (int32_t c = 0; c < 4; ++c)
            {
                float dot = 0.f;
                for (int32_t k = 0; k < 16; ++k)
                {
                    dot += matA[fragCRow(l, c)][k] * matB[k][fragCCol(l, c)];
                }
                acc[l][tileIndex][c] += dot;
            }
        }
    }

    //! xor-shuffle by 1, then by 2, as the GPU reduces a quad.
    template <class Op>
    void quadReduce(float (&v)[kLanes], Op op) const
    {
        float step[kLanes];
        for (int32_t offset = 1; offset <= 2; offset *= 2)
        {
            for (int32_t l = 0; l < kLanes; ++l)
            {
                step[l] = op(v[l], v[l ^ offset]);
            }
            std::copy(step, step + kLanes, v);
        }
    }

    void quadMax(float (&v)[kLanes]) const
    {
        quadReduce(v, [](float x, float y) { return x > y ? x : y; });
    }

    void quadSum(float (&v)[kLanes]) const
    {
        quadReduce(v, [](float x, float y) { return x + y; });
    }
};

template <typename T, typename Cache, int32_t D>
void attendAll(AttentionLaunch const& p, std::vector<int32_t> const& rowStarts)
{
    HostBackend const backend;
    auto smem = std::make_unique<AttentionSmem<T, D>>();
    auto staging = std::make_unique<Fp8Staging<D>>();
    int32_t const rowTiles = rowTilesFor(p.maxQueryLen, groupSize(p));
    for (int32_t request = 0; request < p.numRequests; ++request)
    {
        for (int32_t kvHead = 0; kvHead < p.addressing.numKvHeads; ++kvHead)
        {
            for (int32_t rowTile = 0; rowTile < rowTiles; ++rowTile)
            {
                for (int32_t split = 0; split < p.splits; ++split)
                {
                    auto cta = std::make_unique<AttentionCta<HostBackend, T, Cache, D>>(backend, p, *smem,
                        staging.get(), request, rowStarts[request], kvHead, rowTile, split);
                    if (cta->active())
                    {
                        cta->run();
                    }
                }
            }
        }
    }
}

template <typename T, typename Cache, int32_t D>
void runTyped(AttentionLaunch const& p)
{
    std::vector<int32_t> rowStarts(p.numRequests + 1, 0);
    for (int32_t r = 0; r < p.numRequests; ++r)
    {
        rowStarts[r + 1] = rowStarts[r] + p.genLens[r];
    }
    for (int32_t r = 0; r < p.numRequests; ++r)
    {
        RequestRows const req = requestRows(p, r, rowStarts[r]);
        for (int32_t token = 0; token < p.maxQueryLen; ++token)
        {
            for (int32_t unit = 0; unit < p.numHeads + p.addressing.numKvHeads; ++unit)
            {
                for (int32_t chunk = 0; chunk < D / 16; ++chunk)
                {
                    prepareChunk<T, Cache>(p, req, r, token, unit, chunk);
                }
            }
        }
    }
    attendAll<T, Cache, D>(p, rowStarts);
    if (p.splits > 1)
    {
        for (int32_t r = 0; r < p.numRequests; ++r)
        {
            RequestRows const req = requestRows(p, r, rowStarts[r]);
            for (int32_t token = 0; token < req.queries; ++token)
            {
                for (int32_t head = 0; head < p.numHeads; ++head)
                {
                    int64_t const headRow = static_cast<int64_t>(rowStarts[r] + token) * p.numHeads + head;
                    combineChannels<T>(p, req, headRow, D, 0, D, sizeof(Cache) == 1);
                }
            }
        }
    }
}

template <typename T, typename Cache>
int32_t runForHeadDim(AttentionLaunch const& p)
{
    switch (p.addressing.headDim)
    {
    case 32: runTyped<T, Cache, 32>(p); return 0;
    case 64: runTyped<T, Cache, 64>(p); return 0;
    case 128: runTyped<T, Cache, 128>(p); return 0;
    case 256: runTyped<T, Cache, 256>(p); return 0;
    default: return -1;
    }
}

} // namespace

extern "C"
{

//! The plugin's three steps on host buffers. mask 0 causal / 1 full / 2 tree (positionOffsets [requests]
//! [offsetsStride] and packedMask [tokens][maskWords] read only then). inputType 0 fp16 / 1 bf16; cacheType 0
//! fp16 / 1 bf16 / 2 FP8 (the
//! cache holds the input type unless FP8). splits 0 chooses them as the GPU launch does for `maxKeys` keys and
//! `multiProcessorCount` SMs; otherwise that many splits of `keysPerSplit` keys (0: even). The workspace must hold
//! attentionWorkspaceBound(numTokens, ...) bytes. Returns the number of splits used, or -1 for a bad launch.
int32_t dflashAttentionHost(void const* qkv, void* out, int32_t const* seqLens, int32_t const* genLens,
    float const* cosSin, int32_t const* blockOffsets, int32_t numSeqs, int32_t maxBlocksPerSeq,
    int32_t tokensPerBlock, int32_t numKvHeads, int32_t headDim, int32_t firstLayerInPool, void* primaryPool,
    void* secondaryPool, float const* scaleOrigQuant, float const* scaleQuantOrig, void* workspace,
    int32_t numRequests, int32_t numTokens, int32_t numHeads, int32_t maxQueryLen, int32_t maxPositions,
    int32_t window, int32_t windowFromBlock, int32_t mask, int32_t const* positionOffsets, int32_t offsetsStride,
    int32_t const* packedMask, int32_t maskWords, float qScaling, int32_t inputType, int32_t cacheType,
    int32_t splits, int32_t keysPerSplit, int32_t maxKeys, int32_t multiProcessorCount)
{
    AttentionLaunch p{};
    p.qkv = qkv;
    p.out = out;
    p.seqLens = seqLens;
    p.genLens = genLens;
    p.cosSin = cosSin;
    p.addressing = PagedKVAddressing{blockOffsets, numSeqs, maxBlocksPerSeq, log2PowerOfTwo(tokensPerBlock),
        numKvHeads, headDim, firstLayerInPool};
    p.primaryPool = primaryPool;
    p.secondaryPool = secondaryPool;
    p.scaleOrigQuant = scaleOrigQuant;
    p.scaleQuantOrig = scaleQuantOrig;
    p.workspace = workspace;
    p.numRequests = numRequests;
    p.numTokens = numTokens;
    p.numHeads = numHeads;
    p.maxQueryLen = maxQueryLen;
    p.maxPositions = maxPositions;
    p.window = KeyWindow{window, windowFromBlock != 0 ? WindowAnchor::kBlock : WindowAnchor::kQuery};
    p.mask = static_cast<BlockMask>(mask);
    p.tree = TreeMask{positionOffsets, offsetsStride, packedMask, maskWords};
    p.qScaling = qScaling;
    bool const fp8 = cacheType == 2;
    if (mask < 0 || mask > 2 || attentionLaunchProblem(p, fp8) != nullptr || (!fp8 && cacheType != inputType))
    {
        return -1;
    }
    int32_t const tile = keysPerTile(headDim);
    if (splits <= 0)
    {
        int64_t const baseCtas
            = static_cast<int64_t>(numRequests) * numKvHeads * rowTilesFor(maxQueryLen, numHeads / numKvHeads);
        splits = chooseSplits(baseCtas, maxKeys, tile, 2 * static_cast<int64_t>(multiProcessorCount),
            static_cast<int64_t>(numTokens) * numHeads);
    }
    p.splits = splits;
    p.keysPerSplit = keysPerSplit > 0 ? keysPerSplit : keysPerSplitFor(maxKeys, splits, tile);
    int32_t status = -1;
    if (inputType == 0)
    {
        status = fp8 ? runForHeadDim<__half, __nv_fp8_e4m3>(p) : runForHeadDim<__half, __half>(p);
    }
    else if (inputType == 1)
    {
        status = fp8 ? runForHeadDim<__nv_bfloat16, __nv_fp8_e4m3>(p) : runForHeadDim<__nv_bfloat16, __nv_bfloat16>(p);
    }
    return status == 0 ? splits : -1;
}

int64_t dflashAttentionWorkspaceBound(int64_t maxTokens, int32_t numHeads, int32_t headDim, int32_t inputBytes)
{
    return attentionWorkspaceBound(maxTokens, numHeads, headDim, inputBytes);
}

int32_t dflashKeyVisible(int32_t queryPos, int32_t keyPos, int32_t seqEnd, int32_t mask, int32_t window,
    int32_t windowFromBlock, int32_t past)
{
    KeyWindow const keyWindow{window, windowFromBlock != 0 ? WindowAnchor::kBlock : WindowAnchor::kQuery};
    BlockMask const blockMask = mask == 0 ? BlockMask::kCausal : BlockMask::kFull;
    return keyVisible(queryPos, keyPos, seqEnd, blockMask, keyWindow, past) ? 1 : 0;
}

//! Fragment bookkeeping that must cover each tile element exactly once: writes how often every (row, col) of
//! operand `which` (0: A 16x16, 1: B 16x8, 2: C 16x8, 3: a 16x16 shared-memory tile through each ldmatrix
//! operand's addressing) is hit into `counts`.
void dflashFragmentCoverage(int32_t which, int32_t* counts)
{
    if (which == 0 || which == 1 || which == 2)
    {
        for (int32_t l = 0; l < 32; ++l)
        {
            for (int32_t reg = 0; reg < (which == 0 ? 4 : which == 1 ? 2 : 4); ++reg)
            {
                for (int32_t e = 0; e < (which == 2 ? 1 : 2); ++e)
                {
                    if (which == 0)
                    {
                        ++counts[fragARow(l, reg) * 16 + fragACol(l, reg, e)];
                    }
                    else if (which == 1)
                    {
                        ++counts[fragBK(l, reg, e) * 8 + fragBN(l)];
                    }
                    else
                    {
                        ++counts[fragCRow(l, reg) * 8 + fragCCol(l, reg)];
                    }
                }
            }
        }
        return;
    }
    for (int32_t op = 0; op < 3; ++op)
    {
        for (int32_t l = 0; l < 32; ++l)
        {
            for (int32_t e = 0; e < 8; ++e)
            {
                ++counts[op * 256 + operandRow(static_cast<Operand>(op), l) * 16 + operandCol(static_cast<Operand>(op), l) + e];
            }
        }
    }
}

int32_t dflashSwizzledOffset(int32_t row, int32_t column, int32_t headDim)
{
    return tileElementOffset(row, column, headDim);
}

} // extern "C"
