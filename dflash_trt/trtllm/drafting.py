"""What DFlash2 adds to the drafter network, and a reduced draft vocabulary's head, in TensorRT-LLM 1.2.x ops.

The golden definitions are `reference/conv.py` (the grouped dynamic causal convolution around each draft sublayer)
and `reference/proposal.py` (the selector's walk, the reduced vocabulary's map); this is the same arithmetic on the
draft block's packed rows `[requests * B, hidden]`: slot counts are static, the request count is a runtime tensor.
The selector's walk is unrolled over the draft slots, one chain per request. Imports TensorRT-LLM (GPU hosts; the
CPU emulation runs it against its stand-ins).
"""

from __future__ import annotations

import numpy as np
import tensorrt as trt
from tensorrt_llm._common import default_trtnet
from tensorrt_llm.functional import (
    Tensor,
    _create_tensor,
    arange,
    argmax,
    cast,
    concat,
    constant,
    expand,
    gather,
    index_select,
    slice,
    sum,
    unsqueeze,
)
from tensorrt_llm.layers import ColumnLinear
from tensorrt_llm.module import Module
from tensorrt_llm.parameter import Parameter

BEFORE, AFTER = 0, 1  # rows of a convolution's base kernel and coefficients: before and after the sublayer


def replicated_linear(in_features: int, out_features: int, dtype: str) -> ColumnLinear:
    """A linear every rank holds whole (the drafter's extra modules are small, as dflash.fc is)."""
    return ColumnLinear(
        in_features, out_features, bias=False, dtype=dtype, tp_group=None, tp_size=1, gather_output=True
    )


def topk(x: Tensor, k: int, dim: int) -> tuple[Tensor, Tensor]:
    """The `k` largest values along `dim` (>= 0) and their int32 indices: an ITopKLayer MAX, the layer
    functional.argmax builds with k = 1 [read: 1.2.x functional.py `argmax`; TensorRT's K limit is 3840]."""
    layer = default_trtnet().add_topk(x.trt_tensor, trt.TopKOperation.MAX, k, 1 << dim)
    return _create_tensor(layer.get_output(0), layer), _create_tensor(layer.get_output(1), layer)


class GroupedDynamicConv(Module):
    """One sublayer's pair of convolutions along the block's slots: `base_kernel [2, K, H]` and the projection of
    the sublayer's input to per-group coefficients `[2 * K * groups]`."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int, dtype: str):
        super().__init__()
        self.hidden_size, self.kernel_size, self.group_size = hidden_size, kernel_size, group_size
        self.groups = hidden_size // group_size
        self.block_size = block_size
        self.base_kernel = Parameter(shape=(2, kernel_size, hidden_size), dtype=dtype)
        self.kernel_projection = replicated_linear(hidden_size, 2 * kernel_size * self.groups, dtype)

    def coefficients(self, x: Tensor, batch: Tensor) -> Tensor:
        """`[requests, B, 2, K, groups]` from the sublayer's input rows."""
        projected = self.kernel_projection(x)
        return projected.view(concat([batch, self.block_size, 2, self.kernel_size, self.groups]))

    def convolve(self, x: Tensor, coefficients: Tensor, which: int, batch: Tensor) -> Tensor:
        """`x [requests * B, H]` convolved along each request's slots with kernel `which`: slot s sums
        `x[s - t] * (base[t] + delta[s, t])` over taps t, slots before the block's first adding nothing."""
        b, groups, width = self.block_size, self.groups, self.group_size
        grouped = x.view(concat([batch, b, groups, width]))
        out = None
        for tap in range(self.kernel_size):
            shifted = grouped
            if tap:
                zeros = cast(constant(np.zeros((1, tap, groups, width), dtype=np.float32)), x.dtype)
                kept = slice(grouped, [0, 0, 0, 0], concat([batch, b - tap, groups, width]))
                shifted = concat([expand(zeros, concat([batch, tap, groups, width])), kept], dim=1)
            base = slice(self.base_kernel.value, [which, tap, 0], [1, 1, self.hidden_size])
            delta = slice(coefficients, [0, 0, which, tap, 0], concat([batch, b, 1, 1, groups]))
            term = shifted * (base.view([1, 1, groups, width]) + delta.view(concat([batch, b, groups, 1])))
            out = term if out is None else out + term
        assert out is not None  # kernel_size >= 1
        return out.view(concat([batch * b, self.hidden_size]))


class CandidateSelector(Module):
    """DFlash2's selector: codebooks gathered by token id and the projection of the drafter's hidden state."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, dtype: str):
        super().__init__()
        self.rank, self.top_k = rank, top_k
        self.predecessor_codebook = Parameter(shape=(vocab_size, rank), dtype=dtype)
        self.successor_codebook = Parameter(shape=(vocab_size, rank), dtype=dtype)
        self.hidden_projection = replicated_linear(hidden_size, rank, dtype)

    def _rows(self, codebook: Parameter, ids: Tensor) -> Tensor:
        return cast(index_select(codebook.value, 0, ids), "float32")

    def walk(self, logits: Tensor, hidden: Tensor, anchors: Tensor, batch: Tensor, slots: int) -> Tensor:
        """One chain per request `[requests, slots]` from the draft slots' float32 logits `[requests * slots, V]`
        and hidden states, the first predecessor being each request's anchor `[requests, 1]`."""
        k, rank = self.top_k, self.rank
        unary, candidates = topk(logits, k, 1)
        unary, candidates = unary.view(concat([batch, slots, k])), candidates.view(concat([batch, slots, k]))
        projected = cast(self.hidden_projection(hidden), "float32").view(concat([batch, slots, rank]))
        previous = anchors.view(concat([batch]))
        chain = []
        for slot in range(slots):
            context = self._rows(self.predecessor_codebook, previous) * slice(
                projected, [0, slot, 0], concat([batch, 1, rank])
            ).view(concat([batch, rank]))
            options = slice(candidates, [0, slot, 0], concat([batch, 1, k])).view(concat([batch, k]))
            successors = self._rows(self.successor_codebook, options.view(concat([batch * k])))
            transition = sum(unsqueeze(context, 1) * successors.view(concat([batch, k, rank])), dim=2)
            score = slice(unary, [0, slot, 0], concat([batch, 1, k])).view(concat([batch, k])) + transition
            chosen = gather(options, 1, argmax(score, 1, keepdim=True))
            chain.append(chosen)
            previous = chosen.view(concat([batch]))
        return concat(chain, dim=1)


def draft_vocabulary_map(d2t: Parameter, size: int) -> Tensor:
    """Target id (int32) of every draft id of a reduced vocabulary `[size]`: the draft id plus its `d2t` offset."""
    return d2t.value + arange(0, size, "int32")
