/*
 * The DFlashAttention algorithm, written once for the GPU and for the CPU tests.
 *
 * Everything below is templated on a backend B that says how one call executes a CTA: on the GPU every thread
 * runs the code for itself (one warp, one lane: B::kWarps == B::kLanes == 1) and the backend issues cp.async,
 * ldmatrix, mma.sync and warp shuffles; in the CPU test driver one call runs the whole CTA (4 warps of 32 lanes)
 * and the backend carries out those instructions as the PTX ISA defines them. So the host tests check the exact
 * tiling, fragment bookkeeping, masking, online softmax and split-K of the kernel against a dense reference.
 *
 * Three steps per layer call (see attentionKernel.cu):
 *   prepare  RoPE of the new queries and keys (the plugin's cos/sin table), K/V written into the paged pool at
 *            positions past .. past + n - 1 (cache type, or FP8 with the layer's scale), Q kept in the workspace;
 *   attend   one CTA per (request, kv head, 64 query rows, key split): the 64 rows are all query heads of the
 *            group x the request's new tokens, so each K/V page is read once for the whole group; flash-attention
 *            style tiles of 64 (head dim 256: 32) keys, scores and P V on tensor cores, float32 accumulators;
 *   combine  the splits' partial results weighted by their row maxima (only when the keys were split).
 */
#pragma once

#include "dflash_trt/attentionMath.h"

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__)
#define DFLASH_UNROLL _Pragma("unroll")
#else
#define DFLASH_UNROLL
#endif

namespace dflash_trt
{

//! Everything one launch needs (also the kernels' parameter block).
struct AttentionLaunch
{
    void const* qkv;   //!< [tokens][(heads + 2 kvHeads) * headDim], input type, after the q/k norms
    void* out;         //!< [tokens][heads * headDim], input type
    int32_t const* seqLens; //!< [requests]: past + new tokens
    int32_t const* genLens; //!< [requests]: new tokens (rows of the request, packed in request order)
    float const* cosSin;    //!< float2 [maxPositions][headDim / 2]
    PagedKVAddressing addressing; //!< this pool's block table advanced to the first request's row; its
                                  //!< firstLayerInPool is the layer's index inside the pool
    void* primaryPool;            //!< the pool's base pointers (host_kv_cache_pool_pointers)
    void* secondaryPool;
    float const* scaleOrigQuant; //!< FP8 cache: 1 / kv_cache_scaling_factor (device float[1])
    float const* scaleQuantOrig; //!< FP8 cache: kv_cache_scaling_factor (device float[1])
    void* workspace;
    int32_t numRequests;
    int32_t numTokens;
    int32_t numHeads;
    int32_t maxQueryLen;
    int32_t maxPositions;
    KeyWindow window;
    BlockMask mask;
    TreeMask tree; //!< read only with BlockMask::kTree
    float qScaling;
    int32_t splits;
    int32_t keysPerSplit;
};

//! Workspace a plugin reserves for at most `maxTokens` rows: split-K never holds more than kMaxPartialHeadRows
//! partial (row, head) results (chooseSplits keeps to it).
DFLASH_HD int64_t attentionWorkspaceBound(int64_t maxTokens, int32_t numHeads, int32_t headDim, int32_t inputBytes)
{
    AttentionWorkspace w = attentionWorkspace(maxTokens, numHeads, headDim, 1, inputBytes);
    w.partialOutBytes = kMaxPartialHeadRows * headDim * 4;
    w.partialStatsBytes = kMaxPartialHeadRows * 2 * 4;
    return w.total();
}

//! Why a launch cannot run (null when it can): the shapes and pointers every kernel relies on.
DFLASH_HD char const* attentionLaunchProblem(AttentionLaunch const& p, bool fp8)
{
    int32_t const kvHeads = p.addressing.numKvHeads;
    if (!supportedAttentionHeadDim(p.addressing.headDim))
    {
        return "head_dim must be 32, 64, 128 or 256";
    }
    if (kvHeads <= 0 || p.numHeads <= 0 || p.numHeads % kvHeads != 0)
    {
        return "num_heads must be a positive multiple of num_kv_heads";
    }
    if (p.addressing.tokensPerBlockLog2 < 0)
    {
        return "tokens_per_block must be a power of two";
    }
    if (p.window.size < 0 || p.maxQueryLen <= 0 || p.maxPositions <= 0)
    {
        return "sliding_window, max_query_len and max_positions must be non-negative / positive";
    }
    if (fp8 && (p.scaleOrigQuant == nullptr || p.scaleQuantOrig == nullptr))
    {
        return "an FP8 cache needs both KV scales";
    }
    if (p.mask == BlockMask::kTree
        && (p.window.size != 0 || p.tree.positionOffsets == nullptr || p.tree.packedMask == nullptr
            || p.tree.offsetsStride <= 0 || p.tree.words * 32 < p.maxQueryLen))
    {
        return "a tree mask needs position offsets and packed-mask rows of max_query_len bits, and no window";
    }
    return nullptr;
}

//! One request's rows and keys.
struct RequestRows
{
    int32_t rowStart; //!< its first packed token row
    int32_t queries;  //!< its new tokens
    int32_t past;     //!< positions before them
    int32_t seqEnd;   //!< past + queries
};

DFLASH_HD RequestRows requestRows(AttentionLaunch const& p, int32_t request, int32_t rowStart)
{
    RequestRows r;
    r.rowStart = rowStart;
    r.queries = p.genLens[request];
    r.seqEnd = p.seqLens[request];
    r.past = r.seqEnd - r.queries;
    return r;
}

DFLASH_HD int32_t groupSize(AttentionLaunch const& p)
{
    return p.numHeads / p.addressing.numKvHeads;
}

//! Bits of a 16-bit value, and two of them in one 32-bit register (the first in the low half, as ldmatrix and mma
//! lay out a pair of adjacent elements).
DFLASH_HD uint32_t bitsOf(__half x)
{
    return static_cast<__half_raw>(x).x;
}

DFLASH_HD uint32_t bitsOf(__nv_bfloat16 x)
{
    return static_cast<__nv_bfloat16_raw>(x).x;
}

template <typename T>
DFLASH_HD T fromBits(uint32_t bits);

template <>
DFLASH_HD __half fromBits<__half>(uint32_t bits)
{
    __half_raw raw;
    raw.x = static_cast<uint16_t>(bits);
    return __half(raw);
}

template <>
DFLASH_HD __nv_bfloat16 fromBits<__nv_bfloat16>(uint32_t bits)
{
    __nv_bfloat16_raw raw;
    raw.x = static_cast<uint16_t>(bits);
    return __nv_bfloat16(raw);
}

template <typename T>
DFLASH_HD uint32_t packPair(float lo, float hi)
{
    return bitsOf(toCache<T>(lo, 1.f)) | (bitsOf(toCache<T>(hi, 1.f)) << 16);
}

//! The operand an ldmatrix reads (see attentionMath.h for each one's lane addressing).
enum class Operand : int32_t
{
    kQ = 0,
    kK = 1,
    kV = 2,
};

DFLASH_HD int32_t operandRow(Operand op, int32_t lane)
{
    return op == Operand::kQ ? ldmatrixQRow(lane) : (op == Operand::kK ? ldmatrixKRow(lane) : ldmatrixVRow(lane));
}

DFLASH_HD int32_t operandCol(Operand op, int32_t lane)
{
    return op == Operand::kQ ? ldmatrixQCol(lane) : (op == Operand::kK ? ldmatrixKCol(lane) : ldmatrixVCol(lane));
}

//! Shared memory of one CTA: the 64 query rows, and per pipeline stage the K and V tiles (16-bit caches load
//! straight into them; an FP8 cache loads raw bytes into `staged` and is widened into stage 0).
template <typename T, int32_t D>
struct AttentionSmem
{
    static constexpr int32_t kTile = D == 256 ? 32 : 64;
    T q[kCtaRows * D];
    T k[2][kTile * D];
    T v[2][kTile * D];
};

template <int32_t D>
struct Fp8Staging
{
    static constexpr int32_t kTile = D == 256 ? 32 : 64;
    uint8_t kv[2][2][kTile * D];
};

/*
 * The backend B of one CTA call provides:
 *   kWarps, kLanes                   warps and lanes one call runs (GPU: 1 and 1; CPU driver: 4 and 32)
 *   warpIndex(w), laneIndex(l)       the hardware warp / lane of the call's w-th warp and l-th lane
 *   forThreads(f)                    f(thread) for each CTA thread the call runs (GPU: its own)
 *   sync()                           __syncthreads
 *   copy16(dst, src, valid)          16-byte global -> shared copy, zeros when !valid (GPU: cp.async)
 *   commit(), waitAllButOne(), waitAll()   cp.async groups
 *   ldmatrix<T>(op, regs, tile, row0, col0, headDim)   ldmatrix.x4 (.trans for V) of a swizzled tile
 *   mma<T, N>(acc, tile, a, b, first)                   acc[tile] += A (4 regs) x B (regs first, first + 1)
 *   quadMax(v), quadSum(v)           reduction over the four lanes of a quad (xor-shuffles 1 and 2)
 */
template <class B, typename T, typename Cache, int32_t D>
struct AttentionCta
{
    static constexpr int32_t kTile = AttentionSmem<T, D>::kTile;
    static constexpr int32_t kScoreTiles = kTile / 8;
    static constexpr int32_t kOutTiles = D / 8;
    static constexpr bool kFp8 = sizeof(Cache) == 1;
    static constexpr int32_t kThreads = kCtaRows * 2;

    B const& b;
    AttentionLaunch const& p;
    AttentionSmem<T, D>& smem;
    Fp8Staging<D>* staging;
    int32_t request;
    RequestRows req;
    int32_t kvHead;
    int32_t rowBase;
    int32_t split;
    KeySplit keys;
    float scaleLog2;

    //! The CTA (request, kv head, row tile, split); `rowStart` is the request's first packed row.
    DFLASH_HD AttentionCta(B const& backend, AttentionLaunch const& params, AttentionSmem<T, D>& shared,
        Fp8Staging<D>* fp8Staging, int32_t requestIndex, int32_t rowStart, int32_t kvHeadIndex, int32_t rowTile,
        int32_t splitIndex)
        : b(backend)
        , p(params)
        , smem(shared)
        , staging(fp8Staging)
        , request(requestIndex)
        , req(requestRows(params, requestIndex, rowStart))
        , kvHead(kvHeadIndex)
        , rowBase(rowTile * kCtaRows)
        , split(splitIndex)
        , keys(keySplit(firstVisibleKey(req.past, params.window), req.seqEnd, splitIndex, params.splits,
            params.keysPerSplit, kTile))
        , scaleLog2(softmaxScaleLog2(D, params.qScaling, kFp8 ? *params.scaleQuantOrig : 1.f))
    {
    }

    //! Whether this CTA has rows and keys (the grid covers the longest request and the most splits).
    DFLASH_HD bool active() const
    {
        return rowBase < rows() && keys.begin < keys.end;
    }

    // Per (warp, lane) state; on the GPU both extents are 1. queryPos: position of the lane's two rows (g, g + 8),
    // or -1 past the request's rows.
    int32_t queryPos[B::kWarps][B::kLanes][2];
    float out[B::kWarps][B::kLanes][kOutTiles][4];
    float rowMax[B::kWarps][B::kLanes][2];
    float rowSum[B::kWarps][B::kLanes][2];
    float scores[B::kWarps][B::kLanes][kScoreTiles][4];

    DFLASH_HD int32_t rows() const
    {
        return req.queries * groupSize(p);
    }

    DFLASH_HD bool warpActive(int32_t warp) const
    {
        return rowBase + warp * kWarpRows < rows();
    }

    //! Q rows of this CTA from the workspace into shared memory (zeros past the request's rows).
    DFLASH_HD void loadQueries()
    {
        auto const* q = static_cast<T const*>(p.workspace);
        int32_t const group = groupSize(p);
        int32_t constexpr chunks = D / 8;
        b.forThreads(
            [&](int32_t thread)
            {
                for (int32_t i = thread; i < kCtaRows * chunks; i += kThreads)
                {
                    int32_t const row = i / chunks;
                    int32_t const chunk = i % chunks;
                    int32_t const qRow = rowBase + row;
                    bool const valid = qRow < rows();
                    int32_t const token = valid ? req.rowStart + rowToken(qRow, group) : 0;
                    int32_t const head = kvHead * group + (valid ? rowHeadInGroup(qRow, group) : 0);
                    T const* src = q + (static_cast<int64_t>(token) * p.numHeads + head) * D + chunk * 8;
                    b.copy16(&smem.q[tileElementOffset(row, chunk * 8, D)], src, valid);
                }
            });
    }

    //! Address of the 16 bytes of key `position`'s K or V holding channel `channel`, or null when the key is
    //! outside the split or its block cannot be reached.
    DFLASH_HD void const* cacheChunk(int32_t position, int32_t kv, int32_t channel) const
    {
        if (position >= keys.end)
        {
            return nullptr;
        }
        CacheLocation const loc = locateCacheElement(p.addressing, request, position, 0, kv, kvHead, channel);
        void const* pool = loc.secondary ? p.secondaryPool : p.primaryPool;
        if (!loc.valid || pool == nullptr)
        {
            return nullptr;
        }
        return static_cast<Cache const*>(pool) + loc.element;
    }

    //! Issue the loads of the K and V tile starting at key `first` into pipeline stage `stage`.
    DFLASH_HD void loadTile(int32_t first, int32_t stage)
    {
        int32_t constexpr chunks = D * static_cast<int32_t>(sizeof(Cache)) / 16;
        int32_t constexpr elements = 16 / static_cast<int32_t>(sizeof(Cache));
        b.forThreads(
            [&](int32_t thread)
            {
                for (int32_t i = thread; i < 2 * kTile * chunks; i += kThreads)
                {
                    int32_t const kv = i / (kTile * chunks);
                    int32_t const row = (i / chunks) % kTile;
                    int32_t const chunk = i % chunks;
                    void const* src = cacheChunk(first + row, kv, chunk * elements);
                    void* dst;
                    if constexpr (kFp8)
                    {
                        dst = &staging->kv[stage][kv][row * D + chunk * elements];
                    }
                    else
                    {
                        T* tile = kv == 0 ? smem.k[stage] : smem.v[stage];
                        dst = &tile[tileElementOffset(row, chunk * elements, D)];
                    }
                    b.copy16(dst, src, src != nullptr);
                }
            });
        b.commit();
    }

    //! FP8 only: widen stage `stage`'s raw bytes into the 16-bit tiles of stage 0 (exact: every e4m3 value is a
    //! bf16 / fp16 value); the dequantisation scale is applied to the scores and the output instead.
    DFLASH_HD void widenFp8(int32_t stage)
    {
        if constexpr (kFp8)
        {
            b.forThreads(
                [&](int32_t thread)
                {
                    for (int32_t i = thread; i < 2 * kTile * (D / 8); i += kThreads)
                    {
                        int32_t const kv = i / (kTile * (D / 8));
                        int32_t const row = (i / (D / 8)) % kTile;
                        int32_t const chunk = i % (D / 8);
                        uint8_t const* src = &staging->kv[stage][kv][row * D + chunk * 8];
                        T* tile = kv == 0 ? smem.k[0] : smem.v[0];
                        T* dst = &tile[tileElementOffset(row, chunk * 8, D)];
                        DFLASH_UNROLL
                        for (int32_t e = 0; e < 8; ++e)
                        {
                            __nv_fp8_e4m3 x;
                            x.__x = src[e];
                            dst[e] = toCache<T>(toFloat(x), 1.f);
                        }
                    }
                });
        }
    }

    DFLASH_HD void initState()
    {
        int32_t const group = groupSize(p);
        for (int32_t w = 0; w < B::kWarps; ++w)
        {
            for (int32_t l = 0; l < B::kLanes; ++l)
            {
                DFLASH_UNROLL
                for (int32_t r = 0; r < 2; ++r)
                {
                    rowMax[w][l][r] = -INFINITY;
                    rowSum[w][l][r] = 0.f;
                    int32_t const qRow = rowBase + b.warpIndex(w) * kWarpRows + fragCRow(b.laneIndex(l), 2 * r);
                    queryPos[w][l][r] = qRow < rows() ? req.past + rowToken(qRow, group) : -1;
                }
                DFLASH_UNROLL
                for (int32_t n = 0; n < kOutTiles; ++n)
                {
                    DFLASH_UNROLL
                    for (int32_t c = 0; c < 4; ++c)
                    {
                        out[w][l][n][c] = 0.f;
                    }
                }
            }
        }
    }

    //! Whether the query at `qPos` sees the key at `key`: the layer's mask and window, or the query's row of the
    //! runtime's packed tree mask.
    DFLASH_HD bool sees(int32_t qPos, int32_t key) const
    {
        if (p.mask == BlockMask::kTree)
        {
            int64_t const row = req.rowStart + qPos - req.past;
            return treeKeyVisible(p.tree.packedMask + row * p.tree.words, key, req.seqEnd, req.past);
        }
        return keyVisible(qPos, key, req.seqEnd, p.mask, p.window, req.past);
    }

    //! S = Q K^T of one warp over the tile in `kTile` (m16n8k16: 16 query rows x 8 keys per score tile).
    DFLASH_HD void scoresOf(int32_t w, T const* kTileSmem)
    {
        int32_t const warp = b.warpIndex(w);
        for (int32_t l = 0; l < B::kLanes; ++l)
        {
            DFLASH_UNROLL
            for (int32_t n = 0; n < kScoreTiles; ++n)
            {
                DFLASH_UNROLL
                for (int32_t c = 0; c < 4; ++c)
                {
                    scores[w][l][n][c] = 0.f;
                }
            }
        }
        DFLASH_UNROLL
        for (int32_t kStep = 0; kStep < D / 16; ++kStep)
        {
            uint32_t a[B::kLanes][4];
            b.template ldmatrix<T>(Operand::kQ, a, smem.q, warp * kWarpRows, kStep * 16, D);
            DFLASH_UNROLL
            for (int32_t pair = 0; pair < kTile / 16; ++pair)
            {
                uint32_t kb[B::kLanes][4];
                b.template ldmatrix<T>(Operand::kK, kb, kTileSmem, pair * 16, kStep * 16, D);
                b.template mma<T, kScoreTiles>(scores[w], 2 * pair, a, kb, 0);
                b.template mma<T, kScoreTiles>(scores[w], 2 * pair + 1, a, kb, 2);
            }
        }
    }

    //! Scale, mask and online softmax of one warp's scores for the tile starting at key `first`; leaves P in
    //! `scores` and rescales the running output. A tile wholly in the past (no window) is visible to every row, so
    //! only the tiles at the block, the window's edge or the split's end are masked.
    DFLASH_HD void softmaxOf(int32_t w, int32_t first)
    {
        bool const masked = p.window.size > 0 || first + kTile > req.past || first + kTile > keys.end;
        float tileMax[B::kLanes][2];
        for (int32_t l = 0; l < B::kLanes; ++l)
        {
            int32_t const lane = b.laneIndex(l);
            tileMax[l][0] = tileMax[l][1] = -INFINITY;
            DFLASH_UNROLL
            for (int32_t n = 0; n < kScoreTiles; ++n)
            {
                DFLASH_UNROLL
                for (int32_t c = 0; c < 4; ++c)
                {
                    int32_t const qPos = queryPos[w][l][c / 2];
                    int32_t const key = first + 8 * n + fragCCol(lane, c);
                    bool const visible = !masked || (qPos >= 0 && key < keys.end && sees(qPos, key));
                    float const s = visible ? scores[w][l][n][c] * scaleLog2 : -INFINITY;
                    scores[w][l][n][c] = s;
                    tileMax[l][c / 2] = tileMax[l][c / 2] > s ? tileMax[l][c / 2] : s;
                }
            }
        }
        DFLASH_UNROLL
        for (int32_t half = 0; half < 2; ++half)
        {
            float m[B::kLanes];
            for (int32_t l = 0; l < B::kLanes; ++l)
            {
                m[l] = tileMax[l][half];
            }
            b.quadMax(m);
            for (int32_t l = 0; l < B::kLanes; ++l)
            {
                float const old = rowMax[w][l][half];
                float const updated = old > m[l] ? old : m[l];
                float const alpha = rescaleFactor(old, updated);
                float const base = softmaxBase(updated);
                rowMax[w][l][half] = updated;
                float sum = 0.f;
                DFLASH_UNROLL
                for (int32_t n = 0; n < kScoreTiles; ++n)
                {
                    DFLASH_UNROLL
                    for (int32_t c = 2 * half; c < 2 * half + 2; ++c)
                    {
                        float const e = exp2f(scores[w][l][n][c] - base);
                        scores[w][l][n][c] = e;
                        sum += e;
                    }
                }
                rowSum[w][l][half] = rowSum[w][l][half] * alpha + sum;
                DFLASH_UNROLL
                for (int32_t n = 0; n < kOutTiles; ++n)
                {
                    out[w][l][n][2 * half] *= alpha;
                    out[w][l][n][2 * half + 1] *= alpha;
                }
            }
        }
    }

    //! O += P V of one warp: P (rounded to the input type) is the A operand straight from the score registers.
    DFLASH_HD void accumulate(int32_t w, T const* vTileSmem)
    {
        DFLASH_UNROLL
        for (int32_t kStep = 0; kStep < kTile / 16; ++kStep)
        {
            uint32_t a[B::kLanes][4];
            for (int32_t l = 0; l < B::kLanes; ++l)
            {
                DFLASH_UNROLL
                for (int32_t r = 0; r < 4; ++r)
                {
                    float const* s = scores[w][l][scoreTileOfA(kStep, r)];
                    a[l][r] = packPair<T>(s[scoreElementOfA(r, 0)], s[scoreElementOfA(r, 1)]);
                }
            }
            DFLASH_UNROLL
            for (int32_t pair = 0; pair < D / 16; ++pair)
            {
                uint32_t vb[B::kLanes][4];
                b.template ldmatrix<T>(Operand::kV, vb, vTileSmem, kStep * 16, pair * 16, D);
                b.template mma<T, kOutTiles>(out[w], 2 * pair, a, vb, 0);
                b.template mma<T, kOutTiles>(out[w], 2 * pair + 1, a, vb, 2);
            }
        }
    }

    DFLASH_HD void computeTile(int32_t first, int32_t stage)
    {
        T const* kt = kFp8 ? smem.k[0] : smem.k[stage];
        T const* vt = kFp8 ? smem.v[0] : smem.v[stage];
        for (int32_t w = 0; w < B::kWarps; ++w)
        {
            if (!warpActive(b.warpIndex(w)))
            {
                continue;
            }
            scoresOf(w, kt);
            softmaxOf(w, first);
            accumulate(w, vt);
        }
    }

    //! The key loop: tiles of this split, the next one loading while the current one is computed.
    DFLASH_HD void run()
    {
        initState();
        loadQueries();
        loadTile(keys.begin, 0);
        int32_t stage = 0;
        for (int32_t first = keys.begin; first < keys.end; first += kTile)
        {
            bool const more = first + kTile < keys.end;
            if (more)
            {
                loadTile(first + kTile, stage ^ 1);
                b.waitAllButOne();
            }
            else
            {
                b.waitAll();
            }
            b.sync();
            widenFp8(stage);
            b.sync();
            computeTile(first, stage);
            b.sync();
            stage ^= 1;
        }
        finish();
    }

    //! Row sums over the quad, then the normalised output (one split) or the partial result (several).
    DFLASH_HD void finish()
    {
        float const vScale = kFp8 ? *p.scaleQuantOrig : 1.f;
        int32_t const group = groupSize(p);
        AttentionWorkspace const ws = attentionWorkspace(p.numTokens, p.numHeads, D, p.splits, sizeof(T));
        auto* partialOut = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + ws.partialOutOffset());
        auto* partialStats = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + ws.partialStatsOffset());
        for (int32_t w = 0; w < B::kWarps; ++w)
        {
            int32_t const warp = b.warpIndex(w);
            if (!warpActive(warp))
            {
                continue;
            }
            DFLASH_UNROLL
            for (int32_t half = 0; half < 2; ++half)
            {
                float s[B::kLanes];
                for (int32_t l = 0; l < B::kLanes; ++l)
                {
                    s[l] = rowSum[w][l][half];
                }
                b.quadSum(s);
                for (int32_t l = 0; l < B::kLanes; ++l)
                {
                    int32_t const lane = b.laneIndex(l);
                    int32_t const qRow = rowBase + warp * kWarpRows + fragCRow(lane, 2 * half);
                    if (qRow >= rows())
                    {
                        continue;
                    }
                    int64_t const headRow = static_cast<int64_t>(req.rowStart + rowToken(qRow, group)) * p.numHeads
                        + kvHead * group + rowHeadInGroup(qRow, group);
                    DFLASH_UNROLL
                    for (int32_t n = 0; n < kOutTiles; ++n)
                    {
                        int32_t const col = 8 * n + fragCCol(lane, 2 * half);
                        float const o0 = out[w][l][n][2 * half];
                        float const o1 = out[w][l][n][2 * half + 1];
                        if (p.splits == 1)
                        {
                            T* dst = static_cast<T*>(p.out) + headRow * D + col;
                            float const norm = vScale / s[l];
                            dst[0] = toCache<T>(o0 * norm, 1.f);
                            dst[1] = toCache<T>(o1 * norm, 1.f);
                        }
                        else
                        {
                            float* dst = partialOut + (static_cast<int64_t>(split) * p.numTokens * p.numHeads + headRow) * D;
                            dst[col] = o0;
                            dst[col + 1] = o1;
                        }
                    }
                    if (p.splits > 1 && fragCCol(lane, 0) == 0)
                    {
                        float* stats = partialStats + (static_cast<int64_t>(split) * p.numTokens * p.numHeads + headRow) * 2;
                        stats[0] = rowMax[w][l][half];
                        stats[1] = s[l];
                    }
                }
            }
        }
    }
};

//! Per head-row of the combine step: merge the request's active splits; `channels` of the row's head dim.
template <typename T>
DFLASH_HD void combineChannels(AttentionLaunch const& p, RequestRows const& req, int64_t headRow, int32_t headDim,
    int32_t channelBegin, int32_t channelEnd, bool fp8)
{
    AttentionWorkspace const ws = attentionWorkspace(p.numTokens, p.numHeads, headDim, p.splits, sizeof(T));
    auto const* partialOut = reinterpret_cast<float const*>(static_cast<char const*>(p.workspace) + ws.partialOutOffset());
    auto const* stats = reinterpret_cast<float const*>(static_cast<char const*>(p.workspace) + ws.partialStatsOffset());
    int32_t const tileKeys = keysPerTile(headDim);
    int32_t const active
        = activeSplits(firstVisibleKey(req.past, p.window), req.seqEnd, p.splits, p.keysPerSplit, tileKeys);
    int64_t const stride = static_cast<int64_t>(p.numTokens) * p.numHeads;
    float best = -INFINITY;
    for (int32_t s = 0; s < active; ++s)
    {
        float const m = stats[(s * stride + headRow) * 2];
        best = best > m ? best : m;
    }
    float total = 0.f;
    for (int32_t s = 0; s < active; ++s)
    {
        float const* st = &stats[(s * stride + headRow) * 2];
        total += st[1] * rescaleFactor(st[0], best);
    }
    float const vScale = fp8 ? *p.scaleQuantOrig : 1.f;
    for (int32_t c = channelBegin; c < channelEnd; ++c)
    {
        float acc = 0.f;
        for (int32_t s = 0; s < active; ++s)
        {
            float const weight = rescaleFactor(stats[(s * stride + headRow) * 2], best);
            acc += weight * partialOut[(s * stride + headRow) * headDim + c];
        }
        static_cast<T*>(p.out)[headRow * headDim + c] = toCache<T>(acc * vScale / total, 1.f);
    }
}

//! One (request, token, head, 8-channel rotate-half chunk) of the prepare step: RoPE of Q and K from the table,
//! Q (rounded to the input type) into the workspace, K and V into the paged pool, as the GPT attention plugin's
//! preprocessing writes them (the key rounded to the input type first, then to FP8 with the scale). The cache slot
//! is past + token; the RoPE position is the same but for a tree node (ropePosition).
template <typename T, typename Cache>
DFLASH_HD void prepareChunk(AttentionLaunch const& p, RequestRows const& req, int32_t request, int32_t token,
    int32_t unit, int32_t chunk)
{
    int32_t const headDim = p.addressing.headDim;
    int32_t const half = headDim / 2;
    int32_t const kvHeads = p.addressing.numKvHeads;
    bool const isQuery = unit < p.numHeads;
    int32_t const head = isQuery ? unit : unit - p.numHeads;
    int32_t const position = req.past + token;
    int64_t const row = req.rowStart + token;
    if (token >= req.queries || position < 0)
    {
        return;
    }
    int32_t const rotary = ropePosition(p.mask, p.tree, request, req.past, token);
    if (rotary < 0 || rotary >= p.maxPositions)
    {
        return;
    }
    auto const* qkv = static_cast<T const*>(p.qkv);
    float const scale = p.scaleOrigQuant != nullptr ? *p.scaleOrigQuant : 1.f;
    int32_t const c0 = chunk * 8;
    for (int32_t part = isQuery ? 0 : 1; part < (isQuery ? 1 : 3); ++part)
    {
        DFLASH_UNROLL
        for (int32_t e = 0; e < 8; ++e)
        {
            float const x0 = toFloat(qkv[qkvOffset(row, part, head, c0 + e, p.numHeads, kvHeads, headDim)]);
            float const x1 = toFloat(qkv[qkvOffset(row, part, head, c0 + e + half, p.numHeads, kvHeads, headDim)]);
            float y0 = x0, y1 = x1;
            if (part < 2)
            {
                int64_t const at = 2 * cosSinIndex(rotary, c0 + e, half);
                rotatePair(x0, x1, p.cosSin[at], p.cosSin[at + 1], y0, y1);
            }
            T const r0 = toCache<T>(y0, 1.f);
            T const r1 = toCache<T>(y1, 1.f);
            if (part == 0)
            {
                T* q = static_cast<T*>(p.workspace) + (row * p.numHeads + head) * headDim;
                q[c0 + e] = r0;
                q[c0 + e + half] = r1;
                continue;
            }
            int32_t const kv = part - 1;
            CacheLocation const lo = locateCacheElement(p.addressing, request, position, 0, kv, head, c0 + e);
            CacheLocation const hi = locateCacheElement(p.addressing, request, position, 0, kv, head, c0 + e + half);
            Cache* pool = static_cast<Cache*>(lo.secondary ? p.secondaryPool : p.primaryPool);
            if (!lo.valid || pool == nullptr)
            {
                continue;
            }
            pool[lo.element] = toCache<Cache>(toFloat(r0), scale);
            pool[hi.element] = toCache<Cache>(toFloat(r1), scale);
        }
    }
}

} // namespace dflash_trt
