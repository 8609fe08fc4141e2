/*
 * Index, address, RoPE, mask, window, split and fragment math of the DFlashAttention kernels.
 *
 * Everything the kernels compute about *where* (rows, keys, pages, fragment elements, shared-memory chunks) and
 * *which* (visible keys, active splits) lives here as __host__ __device__ functions, so the CPU tests run exactly
 * the code the GPU runs (tests/engine/test_attention_kernel_host.py) against a dense float32 reference. Nothing here touches
 * TensorRT.
 */
#pragma once

#include "dflash_trt/kvInjectionMath.h"

#include <cstdint>

namespace dflash_trt
{

//! Which block keys a query row sees: itself and earlier ones (the verification chain, causal draft layers), all
//! of them (DFlash's bidirectional block), or those the runtime's packed tree mask sets (a draft tree's
//! verification, TreeMask). Keys before the block (the past) are always candidates.
enum class BlockMask : int32_t
{
    kCausal = 0,
    kFull = 1,
    kTree = 2,
};

//! A draft tree's verification as TensorRT-LLM 1.2.x's runtime feeds it to the attention plugin (docs/engine.md
//! §6.1, §13): new token t of request r (node t) takes RoPE at past + positionOffsets[r * offsetsStride + t] (its
//! depth) and sees block key j iff bit j % 32 of word j / 32 of its packed-mask row is set; the rows of the step's
//! requests follow one another (request r's first row = its first packed token row). Its K / V still go to cache
//! slot past + t (the runtime's rewind moves the accepted path's nodes afterwards).
struct TreeMask
{
    int32_t const* positionOffsets; //!< int32 [requests][offsetsStride] (spec_decoding_position_offsets)
    int32_t offsetsStride;
    int32_t const* packedMask; //!< int32 [rows][words] (spec_decoding_packed_mask)
    int32_t words;
};

//! Bit j of a packed-mask row: word j / 32, bit j % 32 counted from the least significant (getPackedMaskFromPath).
DFLASH_HD bool packedMaskBit(int32_t const* row, int32_t j)
{
    return ((static_cast<uint32_t>(row[j >> 5]) >> (j & 31)) & 1u) != 0;
}

//! Whether a tree node whose packed-mask row is `maskRow` sees the key at `keyPos` of a request whose block starts
//! at `past`: every key of the past, and the block keys its row sets.
DFLASH_HD bool treeKeyVisible(int32_t const* maskRow, int32_t keyPos, int32_t seqEnd, int32_t past)
{
    if (keyPos < 0 || keyPos >= seqEnd)
    {
        return false;
    }
    return keyPos < past || packedMaskBit(maskRow, keyPos - past);
}

//! The RoPE position of new token `token` of `request` (block at `past`): its cache slot, or for a tree node the
//! anchor plus its depth from the runtime's position offsets.
DFLASH_HD int32_t ropePosition(BlockMask mask, TreeMask const& tree, int32_t request, int32_t past, int32_t token)
{
    if (mask != BlockMask::kTree)
    {
        return past + token;
    }
    return past + tree.positionOffsets[static_cast<int64_t>(request) * tree.offsetsStride + token];
}

//! Query rows of one CTA (4 warps of 16 rows, the m16 of the tensor-core tile).
constexpr int32_t kWarpRows = 16;
constexpr int32_t kCtaWarps = 4;
constexpr int32_t kCtaRows = kWarpRows * kCtaWarps;
//! Most splits of one request's keys (split-K); the combine kernel reduces them.
constexpr int32_t kMaxSplits = 32;
//! Most partial (row, head) results the workspace holds for split-K; beyond it the kernel runs unsplit.
constexpr int64_t kMaxPartialHeadRows = int64_t{1} << 17;
//! Head dims the kernels are instantiated for (32 for small models such as the embedded self-test pair).
DFLASH_HD bool supportedAttentionHeadDim(int32_t headDim)
{
    return headDim == 32 || headDim == 64 || headDim == 128 || headDim == 256;
}

//! Keys per shared-memory tile: 64, or 32 for head dim 256 (registers of the output accumulators).
DFLASH_HD int32_t keysPerTile(int32_t headDim)
{
    return headDim == 256 ? 32 : 64;
}

//! Where a sliding window counts from: each query (HF sliding attention, the z-lab drafters) or the block's anchor,
//! the request's first new position (speculators drafters: the `size` positions before it and the whole block).
enum class WindowAnchor : int32_t
{
    kQuery = 0,
    kBlock = 1,
};

//! A layer's sliding window; size 0 = none.
struct KeyWindow
{
    int32_t size;
    WindowAnchor anchor;
};

//! Whether the query at `queryPos` of a request whose new tokens start at `past` sees the key at `keyPos` of its
//! `seqEnd` positions, as the golden model's draft_visibility defines it: causal drops later keys; a window counted
//! from the query drops keys `size` or more positions behind (and, for a bidirectional block, ahead), one counted
//! from the block drops keys before `past - size`.
DFLASH_HD bool keyVisible(
    int32_t queryPos, int32_t keyPos, int32_t seqEnd, BlockMask mask, KeyWindow window, int32_t past)
{
    if (keyPos < 0 || keyPos >= seqEnd)
    {
        return false;
    }
    if (mask == BlockMask::kCausal && keyPos > queryPos)
    {
        return false;
    }
    if (window.size > 0 && window.anchor == WindowAnchor::kBlock)
    {
        return keyPos >= past - window.size;
    }
    if (window.size > 0)
    {
        if (queryPos - keyPos >= window.size)
        {
            return false;
        }
        if (mask == BlockMask::kFull && keyPos - queryPos >= window.size)
        {
            return false;
        }
    }
    return true;
}

//! The first key position any query of a request sees: its first query sits at `past`.
DFLASH_HD int32_t firstVisibleKey(int32_t past, KeyWindow window)
{
    int32_t const first = window.anchor == WindowAnchor::kBlock ? past - window.size : past - window.size + 1;
    return window.size <= 0 || first <= 0 ? 0 : first;
}

//! One split of a request's keys: [begin, end); empty when begin >= end.
struct KeySplit
{
    int32_t begin;
    int32_t end;
};

//! Split `split` of `splits` of the keys a request reads: from its first visible key (rounded down to a tile) in
//! chunks of `keysPerSplit` (a multiple of the tile); the last split runs to the sequence end whatever the chunk
//! size, so a launch sized from a low length bound is slower, never wrong.
DFLASH_HD KeySplit keySplit(
    int32_t firstKey, int32_t seqEnd, int32_t split, int32_t splits, int32_t keysPerSplit, int32_t tileKeys)
{
    int32_t const start = firstKey - firstKey % tileKeys;
    int64_t const begin = static_cast<int64_t>(start) + static_cast<int64_t>(split) * keysPerSplit;
    int64_t const end = split == splits - 1 ? seqEnd : begin + keysPerSplit;
    KeySplit s;
    s.begin = begin < seqEnd ? static_cast<int32_t>(begin) : seqEnd;
    s.end = end < seqEnd ? static_cast<int32_t>(end) : seqEnd;
    return s;
}

//! How many of the `splits` splits hold keys of the request (the combine step reduces these).
DFLASH_HD int32_t activeSplits(int32_t firstKey, int32_t seqEnd, int32_t splits, int32_t keysPerSplit, int32_t tileKeys)
{
    int32_t const start = firstKey - firstKey % tileKeys;
    if (seqEnd <= start)
    {
        return 0;
    }
    int32_t const needed = (seqEnd - start + keysPerSplit - 1) / keysPerSplit;
    return needed < splits ? needed : splits;
}

//! A query row of a request's (token, head-in-group) grid: row = token * groupSize + headInGroup, so the rows of one
//! token are adjacent and share one causal / window boundary.
DFLASH_HD int32_t rowToken(int32_t row, int32_t groupSize)
{
    return row / groupSize;
}

DFLASH_HD int32_t rowHeadInGroup(int32_t row, int32_t groupSize)
{
    return row % groupSize;
}

//! CTAs along the rows of one (request, kv head): ceil(maxQueryLen * groupSize / kCtaRows).
DFLASH_HD int32_t rowTilesFor(int32_t maxQueryLen, int32_t groupSize)
{
    return (maxQueryLen * groupSize + kCtaRows - 1) / kCtaRows;
}

//! Element offset of (token, head, channel) in the packed QKV input [tokens][(heads + 2 kvHeads) * headDim]:
//! part 0 = Q (head < numHeads), 1 = K, 2 = V (head < numKvHeads), as the attention layer's qkv GEMM lays them out.
DFLASH_HD int64_t qkvOffset(int64_t token, int32_t part, int32_t head, int32_t channel, int32_t numHeads,
    int32_t numKvHeads, int32_t headDim)
{
    int64_t const width = static_cast<int64_t>(numHeads + 2 * numKvHeads) * headDim;
    int64_t const partStart = part == 0 ? 0 : static_cast<int64_t>(numHeads + (part - 1) * numKvHeads) * headDim;
    return token * width + partStart + static_cast<int64_t>(head) * headDim + channel;
}

//! RoPE of a rotate-half pair (x[i], x[i + half]) with (cos, sin) of frequency i from the attention plugin's table
//! (`rotary_cos_sin`: float2 [positions][rotaryDim / 2]); float32, as the plugin's preprocessing rotates.
DFLASH_HD void rotatePair(float x0, float x1, float c, float s, float& y0, float& y1)
{
    y0 = x0 * c - x1 * s;
    y1 = x1 * c + x0 * s;
}

//! Index of frequency i at `position` in the float2 table.
DFLASH_HD int64_t cosSinIndex(int32_t position, int32_t i, int32_t halfRotaryDim)
{
    return static_cast<int64_t>(position) * halfRotaryDim + i;
}

//! Scores are kept in base 2: s * (1 / (sqrt(d) * qScaling)) * log2(e), exp2 instead of exp.
constexpr float kLog2e = 1.4426950408889634f;

DFLASH_HD float softmaxScaleLog2(int32_t headDim, float qScaling, float kScale)
{
    return kScale * kLog2e / (sqrtf(static_cast<float>(headDim)) * qScaling);
}

//! Online softmax: the base a row's exponents are taken against (a row that has seen no key yet uses 0, so
//! exp2(-inf - base) is 0 rather than NaN), and the factor an earlier partial result is rescaled by.
DFLASH_HD float softmaxBase(float runningMax)
{
    return runningMax == -INFINITY ? 0.f : runningMax;
}

DFLASH_HD float rescaleFactor(float oldMax, float newMax)
{
    return oldMax == -INFINITY ? 0.f : exp2f(oldMax - softmaxBase(newMax));
}

//! Offsets into the workspace: the rotated Q [tokens][heads][headDim] of the input type, then per split the
//! unnormalised partial outputs [splits][tokens][heads][headDim] and (max, sum) pairs [splits][tokens][heads] of
//! float32. Every section starts 256-byte aligned.
struct AttentionWorkspace
{
    int64_t qBytes;
    int64_t partialOutBytes;
    int64_t partialStatsBytes;

    DFLASH_HD int64_t qOffset() const
    {
        return 0;
    }
    DFLASH_HD int64_t partialOutOffset() const
    {
        return roundUp256(qBytes);
    }
    DFLASH_HD int64_t partialStatsOffset() const
    {
        return partialOutOffset() + roundUp256(partialOutBytes);
    }
    DFLASH_HD int64_t total() const
    {
        return partialStatsOffset() + roundUp256(partialStatsBytes);
    }
    static DFLASH_HD int64_t roundUp256(int64_t x)
    {
        return (x + 255) / 256 * 256;
    }
};

DFLASH_HD AttentionWorkspace attentionWorkspace(
    int64_t tokens, int32_t numHeads, int32_t headDim, int32_t splits, int32_t inputBytes)
{
    AttentionWorkspace w;
    int64_t const headRows = tokens * numHeads;
    w.qBytes = headRows * headDim * inputBytes;
    bool const split = splits > 1;
    w.partialOutBytes = split ? static_cast<int64_t>(splits) * headRows * headDim * 4 : 0;
    w.partialStatsBytes = split ? static_cast<int64_t>(splits) * headRows * 2 * 4 : 0;
    return w;
}

//! Splits for a launch: enough CTAs to fill the GPU about twice (`targetCtas`) over the base grid of
//! (requests x kv heads x row tiles), each split at least four tiles long, and within the workspace's budget.
DFLASH_HD int32_t chooseSplits(
    int64_t baseCtas, int32_t maxKeys, int32_t tileKeys, int64_t targetCtas, int64_t headRows)
{
    if (baseCtas <= 0 || maxKeys <= 0)
    {
        return 1;
    }
    int64_t splits = (targetCtas + baseCtas - 1) / baseCtas;
    int64_t const byLength = (maxKeys + 4 * tileKeys - 1) / (4 * tileKeys);
    splits = splits < byLength ? splits : byLength;
    splits = splits < kMaxSplits ? splits : kMaxSplits;
    int64_t const byBudget = headRows > 0 ? kMaxPartialHeadRows / headRows : 1;
    splits = splits < byBudget ? splits : byBudget;
    return splits < 1 ? 1 : static_cast<int32_t>(splits);
}

//! Keys per split for `splits` splits over at most `maxKeys` keys, rounded up to whole tiles.
DFLASH_HD int32_t keysPerSplitFor(int32_t maxKeys, int32_t splits, int32_t tileKeys)
{
    int32_t const per = (maxKeys + splits - 1) / splits;
    int32_t const tiles = (per + tileKeys - 1) / tileKeys;
    return (tiles < 1 ? 1 : tiles) * tileKeys;
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core fragments (PTX ISA, `mma.sync.aligned.m16n8k16` with 16-bit inputs and float32 accumulators, and
// `ldmatrix.sync.aligned.m8n8.x4`). Lane l of a warp has group g = l / 4 and thread-in-group t = l % 4.
// ---------------------------------------------------------------------------------------------------------------

//! A (16 x 16, row-major) register r in 0..3 holds two adjacent elements; element e in 0..1 of register r sits at
//! row g + 8 * (r % 2), column 2t + e + 8 * (r / 2).
DFLASH_HD int32_t fragARow(int32_t lane, int32_t reg)
{
    return lane / 4 + 8 * (reg % 2);
}

DFLASH_HD int32_t fragACol(int32_t lane, int32_t reg, int32_t element)
{
    return 2 * (lane % 4) + element + 8 * (reg / 2);
}

//! B (16 x 8, "col": element (k, n)) register r in 0..1, element e: k = 2t + e + 8r, n = g.
DFLASH_HD int32_t fragBK(int32_t lane, int32_t reg, int32_t element)
{
    return 2 * (lane % 4) + element + 8 * reg;
}

DFLASH_HD int32_t fragBN(int32_t lane)
{
    return lane / 4;
}

//! C / D (16 x 8, float32) element c in 0..3: row g + 8 * (c / 2), column 2t + c % 2.
DFLASH_HD int32_t fragCRow(int32_t lane, int32_t c)
{
    return lane / 4 + 8 * (c / 2);
}

DFLASH_HD int32_t fragCCol(int32_t lane, int32_t c)
{
    return 2 * (lane % 4) + c % 2;
}

//! P as the A operand of P V, straight from the score accumulators: A register r of k-step s (keys 16s..16s+15)
//! is the pair (c, c + 1) of score n-tile 2s + r / 2, with c = 2 * (r % 2).
DFLASH_HD int32_t scoreTileOfA(int32_t kStep, int32_t reg)
{
    return 2 * kStep + reg / 2;
}

DFLASH_HD int32_t scoreElementOfA(int32_t reg, int32_t element)
{
    return 2 * (reg % 2) + element;
}

//! ldmatrix.x4: lane l gives the address of row l % 8 of 8x8 matrix l / 8, and receives in register m the elements
//! (l / 4, 2(l % 4)) and (l / 4, 2(l % 4) + 1) of matrix m (with .trans: (2(l % 4), l / 4) and (2(l % 4) + 1, l / 4)).
//! The three operands are read as follows; each returns the (row, column) of the 16 x 16 shared-memory tile whose
//! address lane l provides (row = query / key, column = head channel for Q and K; row = key, column = channel for V).
//!
//! Q (A of Q K^T): matrices (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = A registers 0..3.
DFLASH_HD int32_t ldmatrixQRow(int32_t lane)
{
    return lane % 16;
}

DFLASH_HD int32_t ldmatrixQCol(int32_t lane)
{
    return 8 * (lane / 16);
}

//! K (B of Q K^T, n = key, k = channel), two key n-tiles at once: matrices (keys 0-7, ch 0-7), (0-7, 8-15),
//! (8-15, 0-7), (8-15, 8-15) = (B register 0, 1) of key tile 0, then of key tile 1.
DFLASH_HD int32_t ldmatrixKRow(int32_t lane)
{
    return 8 * (lane / 16) + lane % 8;
}

DFLASH_HD int32_t ldmatrixKCol(int32_t lane)
{
    return 8 * ((lane / 8) % 2);
}

//! V (B of P V, k = key, n = channel) with .trans, two channel n-tiles at once: matrices (keys 0-7, ch 0-7),
//! (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = (B register 0, 1) of channel tile 0, then of channel tile 1.
DFLASH_HD int32_t ldmatrixVRow(int32_t lane)
{
    return 8 * ((lane / 8) % 2) + lane % 8;
}

DFLASH_HD int32_t ldmatrixVCol(int32_t lane)
{
    return 8 * (lane / 16);
}

//! Shared-memory tiles hold rows of headDim 16-bit elements in 16-byte chunks; chunk c of row r is stored at chunk
//! c ^ (r % w), w = min(8, chunks per row), so the eight rows an ldmatrix matrix reads fall in different bank groups
//! (all eight from head dim 64 on).
DFLASH_HD int32_t swizzledChunk(int32_t row, int32_t chunk, int32_t chunksPerRow)
{
    int32_t const width = chunksPerRow < 8 ? chunksPerRow : 8;
    return chunk ^ (row % width);
}

DFLASH_HD int32_t tileElementOffset(int32_t row, int32_t column, int32_t headDim)
{
    int32_t const chunk = column / 8;
    return row * headDim + swizzledChunk(row, chunk, headDim / 8) * 8 + column % 8;
}

} // namespace dflash_trt
