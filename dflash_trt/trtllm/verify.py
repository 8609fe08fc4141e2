"""In-graph verification of the drafts, per request greedy (temperature 0) or sampled exactly (docs/engine.md §6).

Replaces the stock EAGLE accept plugin, whose non-greedy mode is typical acceptance (not distribution-preserving)
and which is greedy or not for the whole batch. Per request `b` with temperature `T_b`, each verified position `j`
gets one target token `x_j`: argmax at `T_b = 0`, otherwise the inverse-CDF sample of softmax(z_j / T_b) at the
runtime's uniform `u_j`. The drafts (argmax of the drafter) are accepted while `x_j` equals them; the first
mismatching `x_j` is the bonus token. Uniforms: `rand_data_validation[b, j]` for a generation request (fresh each
step), `rand_data_sample[b]` for a context request, whose first token is sampled from its single logits row (the
runtime draws it when the request is set up; its `rand_data_validation` row is stale then).
`dflash_trt.reference.sampling.exact_match_accept` is the same rule in torch; tests replay these ops against it.
Only tensorrt_llm.functional ops. The inverse CDF is two-level (block masses, then one block) so that no prefix sum
runs over the whole vocabulary in fp32; the prefix sums use TensorRT-LLM's CumsumLastDim plugin (an fp32 scan,
where a matmul with a triangular matrix could round through TF32). The whole sampling path sits in one branch of a
TensorRT conditional on the batch-wide flag "some request samples": a step whose every request is greedy runs the
other branch, one argmax per row (`pick_tokens`).
"""

from __future__ import annotations

import numpy as np
from tensorrt_llm.functional import (
    Conditional,
    Tensor,
    argmax,
    cast,
    concat,
    constant,
    cumsum,
    eq,
    exp,
    expand,
    gather,
    index_select,
    max,
    minimum,
    shape,
    slice,
    sum,
    unsqueeze,
    where,
)

from dflash_trt.sampling_rules import MAX_SAMPLING_TEMPERATURE, MIN_SAMPLING_TEMPERATURE
from dflash_trt.trtllm.inverse_cdf import vocab_blocks


def i32(values) -> Tensor:
    """An int32 constant of the network (the engine's sources share this one)."""
    return constant(np.ascontiguousarray(np.array(values, dtype=np.int32)))


def f32(values) -> Tensor:
    """A float32 constant of the network."""
    return constant(np.ascontiguousarray(np.array(values, dtype=np.float32)))


def slot_logit_rows(draft_lens: Tensor, max_draft_len: int) -> Tensor:
    """Packed logits row of every (request, slot j <= K): the runtime gathers `draft_lens + 1` rows per request
    (assembleTargetLogitsOffsets); slots past a request's rows repeat its last row and are never read."""
    rows = draft_lens + 1
    offsets = cumsum(rows, 0, prefer_plugin=False) - rows
    local = minimum(i32([list(range(max_draft_len + 1))]), unsqueeze(draft_lens, 1))
    return (unsqueeze(offsets, 1) + local).view(concat([shape(draft_lens, 0) * (max_draft_len + 1)]))


def _first_reaching(cdf: Tensor, mass: Tensor, threshold: Tensor, size: int) -> Tensor:
    """Index `[N, 1]` of the first entry of positive `mass` whose `cdf` reaches `threshold`; where fp32 rounding
    leaves every such `cdf` below it, the last entry of positive mass (whose exact cdf does reach it). A
    zero-mass entry is never chosen, whatever the uniform (curand's lie in (0, 1], so 0+ and 1.0 both occur)."""
    positive = cast(mass > 0.0, "int32")
    candidate = positive * cast(cdf >= threshold, "int32")
    slots = i32([list(range(size))])
    # max of -j over candidates is minus the first one; -size where there is none.
    first = i32([0]) - max(where(candidate > 0, i32([[-j for j in range(size)]]), i32([[-size]])), 1)
    last_positive = max(where(positive > 0, slots, i32([[-1]])), 1)
    return where(first < size, first, last_positive).view([-1, 1])


def _greedy(temperature: Tensor) -> Tensor:
    """Rows that decode greedily: `sampling_rules.is_greedy` in-graph (below the minimum, 0 included)."""
    return temperature < f32([[MIN_SAMPLING_TEMPERATURE]])


def sample_rows(logits: Tensor, temperature: Tensor, uniform: Tensor, vocab_size: int) -> Tensor:
    """One token per row of `logits [N, Vpad]` (fp32; columns from `vocab_size` on are lm_head padding): argmax where
    `temperature [N, 1]` is below the minimum (0 included), else the inverse CDF of softmax(z / T) at `uniform [N, 1]`:
    the block whose cumulative mass first reaches `uniform` times the total, then the token inside it; only tokens
    of positive weight are ever drawn (padding has none). Returns [N, 1] int32."""
    padded = logits.size(-1)
    rows = shape(logits, 0)
    if padded > vocab_size:
        logits = logits + f32([[0.0] * vocab_size + [-np.inf] * (padded - vocab_size)])
    # sampling_rules.effective_temperature in-graph: greedy below the minimum, capped at the maximum, so no temperature
    # the runtime passes (1e-40, a denormal, 3e38) gives an infinite or vanishing inverse.
    greedy = _greedy(temperature)
    inverse = f32([[1.0]]) / where(greedy, f32([[1.0]]), minimum(temperature, f32([[MAX_SAMPLING_TEMPERATURE]])))
    weights = exp((logits - max(logits, 1, keepdim=True)) * inverse)
    count, width = vocab_blocks(padded)
    if count * width > padded:
        weights = concat(
            [weights, expand(f32([[0.0] * (count * width - padded)]), concat([rows, count * width - padded]))], dim=1
        )
    blocks = weights.view([-1, count, width])
    block_mass = sum(blocks, dim=2)
    block_cdf = cumsum(block_mass, 1)
    threshold = uniform * slice(block_cdf, [0, count - 1], concat([rows, 1]))
    block = _first_reaching(block_cdf, block_mass, threshold, count)
    before = gather(block_cdf - block_mass, 1, block)
    inside = gather(blocks, 1, expand(block.view([-1, 1, 1]), concat([rows, 1, width]))).view([-1, width])
    offset = _first_reaching(cumsum(inside, 1), inside, threshold - before, width)
    return where(greedy, cast(argmax(logits, 1, keepdim=True), "int32"), block * width + offset)


def greedy_rows(logits: Tensor, vocab_size: int) -> Tensor:
    """The argmax token of each row of `logits [N, Vpad]` over the real vocabulary (never an lm_head padding
    column, whatever its logit). Returns [N, 1] int32."""
    if logits.size(-1) > vocab_size:
        logits = slice(logits, [0, 0], concat([shape(logits, 0), vocab_size]))
    return cast(argmax(logits, 1, keepdim=True), "int32")


def pick_tokens(logits: Tensor, temperature: Tensor, uniform: Tensor, vocab_size: int) -> Tensor:
    """`sample_rows` where some row of the step samples; otherwise `greedy_rows` alone. A TensorRT conditional
    on the batch-wide flag: TensorRT runs only the branch it takes, so an all-greedy step reads its logits once
    instead of paying the sampling path (max, exp, padding, block sums, argmax: about seven passes over `[N, Vpad]`
    fp32) [read: functional.py `Conditional`; TensorRT-LLM's attention.py builds its cross-KV projection in one the
    same way]. Greedy is `_greedy`'s rule, so temperatures too small to invert take the fast path too. Returns
    [N, 1] int32."""
    samples = i32([[1]]) - cast(_greedy(temperature), "int32")
    sampling = max(samples.view([-1]), 0) > 0
    conditional = Conditional(sampling)
    rows, temperatures, uniforms = (conditional.add_input(t) for t in (logits, temperature, uniform))
    return conditional.add_output(sample_rows(rows, temperatures, uniforms, vocab_size), greedy_rows(rows, vocab_size))


def verify_drafts(
    logits: Tensor,
    draft_tokens: Tensor,
    draft_lens: Tensor,
    temperature: Tensor,
    rand_data_validation: Tensor,
    rand_data_sample: Tensor,
    vocab_size: int,
    max_draft_len: int,
) -> tuple[Tensor, Tensor]:
    """(accepted_tokens [bs, K+1], num_accepted_tokens [bs]) as the runtime reads them: the first n tokens are the
    accepted drafts and the bonus, n >= 1. `logits` are the packed target rows (padded vocabulary allowed)."""
    k = max_draft_len
    batch = shape(draft_lens, 0)
    width = concat([batch, k + 1])
    rows = index_select(logits, 0, slot_logit_rows(draft_lens, k))
    per_slot = concat([batch * (k + 1), 1])
    temperatures = expand(unsqueeze(temperature, 1), width).view(per_slot)
    generation = expand(unsqueeze(draft_lens > 0, 1), width)
    uniforms = where(generation, rand_data_validation, expand(unsqueeze(rand_data_sample, 1), width))
    tokens = pick_tokens(rows, temperatures, uniforms.view(per_slot), vocab_size).view(width)

    # Slot j < draft_len keeps draft j while the sample equals it; the first slot that does not is the bonus.
    drafts = concat([draft_tokens, expand(i32([[-1]]), concat([batch, 1]))], dim=1)
    slots = i32([list(range(k + 1))])
    kept = cast(eq(tokens, drafts), "int32") * cast(slots < unsqueeze(draft_lens, 1), "int32")
    # max over j of -j (rejected) or -(K+1) (kept) is minus the first rejected slot; slot K is always rejected.
    negated = where(kept > 0, i32([[-(k + 1)]]), i32([[-j for j in range(k + 1)]]))
    first_rejected = i32([0]) - max(negated, 1)
    return tokens, first_rejected + 1
