"""The speculative decoding loop of docs/engine.md, batched over ragged prompts; it defines what the engine must do.

Per step and per sequence: draft a block `[anchor, MASK…]` from the accepted context, verify it with the target,
accept the longest matching prefix plus one target token, inject the accepted tokens' tap features into the
drafter's context cache, and rewind (a shorter length) everything else. Block size 1 is plain autoregressive
decoding with the same target, the baseline every speedup is measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflash_trt.draft_schedule import FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import draft_tree_nodes
from dflash_trt.reference.loop_rules import check_request, keep_tokens
from dflash_trt.reference.model import DraftModel, GoldenModel, KVCache, TreeBlock
from dflash_trt.reference.proposal import DraftChoice
from dflash_trt.reference.sampling import (
    SamplingParams,
    exact_match_accept,
    pick_tokens,
    rejection_accept,
    sample_by_uniform,
    sampling_probs,
)
from dflash_trt.reference.tree import DraftTree, budget_tree, log_probs, tree_accept
from dflash_trt.sampling_rules import ENGINE, REFERENCE, sampling_refusal
from dflash_trt.spec import DraftSpec


@dataclass
class StepTrace:
    """One verify step: the drafted tokens and how many were accepted. A tree step also lists each node's parent
    (nodes 1..n breadth-first, 0 the anchor), and its accepted drafts are the accepted path's nodes below the anchor."""

    draft_ids: list[int]
    accepted: int
    parents: list[int] | None = None
    # The drafter's rank (1 = its best) of the target's token at each draft position the step reached: the accepted
    # drafts', then the bonus token's where a draft position was left (None: not among the drafter's candidates).
    ranks: list[int | None] | None = None
    positions: int | None = None  # a tree step's draft positions (the block's, or fewer near the output budget)

    @property
    def drafted_positions(self) -> int:
        """The draft positions the step drafted: a chain's length, or how deep its tree could grow."""
        return len(self.draft_ids) if self.positions is None else self.positions

    @property
    def depth(self) -> int:
        """The deepest draft position the step proposed (a chain's length)."""
        if self.parents is None:
            return len(self.draft_ids)
        return DraftTree(tuple(self.draft_ids), tuple(self.parents)).depth


@dataclass
class SequenceResult:
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    steps: list[StepTrace] = field(default_factory=list)


@dataclass
class _Sequence:
    result: SequenceResult
    tokens: list[int]
    max_length: int
    stopped: bool = False

    @property
    def start(self) -> int:
        """Index of the current anchor: the last token produced, not yet in the target's KV cache."""
        return len(self.tokens) - 1

    @property
    def active(self) -> bool:
        return not self.stopped and self.start + 1 < self.max_length


def _check_prompts(prompts: list[list[int]], vocab_size: int, max_new_tokens: list[int]) -> None:
    if not prompts:
        raise DFlashTrtError("no prompts given")
    for i, (prompt, new) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        check_request(i, prompt, new, vocab_size)


def per_sequence_sampling(sampling: SamplingParams | list[SamplingParams] | None, batch: int) -> list[SamplingParams]:
    """One SamplingParams per sequence; refuses what the engine method cannot honour (top-k / top-p)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling or SamplingParams()] * batch
    else:
        params = list(sampling)
        if len(params) != batch:
            raise DFlashTrtError(f"got {len(params)} sampling settings for {batch} prompts")
    if any(p.method == REFERENCE and not p.greedy for p in params) and len(set(params)) > 1:
        raise DFlashTrtError("the reference sampling method takes one setting for the whole batch")
    for p in params:
        if p.method != REFERENCE:
            refusal = sampling_refusal({"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k})
            if refusal is not None:
                raise DFlashTrtError(f"{refusal} (the reference method honours it: --sampling reference)")
    return params


class _AcceptRule(Protocol):
    """How a step picks tokens: the first token after the prompt, the drafts of a block, and the accepted prefix
    plus one target token of each verified block. Chosen once per call."""

    def first(self, last_logits: torch.Tensor) -> torch.Tensor: ...

    def draft(self, drafter: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor: ...

    def accept(self, row: int, drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]: ...


@dataclass
class _EngineRule:
    """The engine's exact-match rule: drafts are the drafter's argmax; each sequence draws its own uniforms."""

    generators: list[torch.Generator]
    temperatures: list[float]
    block: int  # uniforms per verify step: the engine's verify width (anchor + its most drafts or tree nodes)
    choice: DraftChoice | None = None  # the last block's drafter scores, for the ranks of the target's tokens

    def ranks(self, row: int, tokens: list[int], positions: int) -> list[int | None]:
        """The drafter's rank of `tokens` (the target's, one per draft position from the first) in the last block,
        at the step's first `positions` draft positions."""
        if positions == 0:  # a block of 1 (plain autoregressive decoding) drafts nothing
            return []
        assert self.choice is not None  # set by draft() / trees() before any verification
        return [self.choice.rank(row, slot, tokens[slot]) for slot in range(min(len(tokens), positions))]

    def first(self, last_logits: torch.Tensor) -> torch.Tensor:
        # The runtime's first uniform of a request (rand_data_sample, drawn when the request is set up).
        return torch.cat(
            [
                sample_by_uniform(last_logits[b : b + 1], self.temperatures[b], torch.rand(1, generator=g))
                for b, g in enumerate(self.generators)
            ]
        )

    def draft(self, drafter: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        self.choice = drafter.choose(hidden, anchors)
        return self.choice.tokens()

    def accept(self, row: int, drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
        # The runtime hands the engine one uniform per verified position (rand_data_validation).
        uniforms = torch.rand(self.block, generator=self.generators[row])[: len(logits)]
        return exact_match_accept(drafts, logits, self.temperatures[row], uniforms)

    def trees(
        self, drafter: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor, depths: list[int], budget: int
    ) -> list[DraftTree]:
        """Each sequence's draft for a node budget of `budget` over its first `depths[b]` draft positions: the best
        tree of `budget` nodes, or the chain of `budget` drafts where the budget does not exceed the block's."""
        choice = self.choice = drafter.choose(hidden, anchors)
        logprobs = log_probs(choice.scores)
        ids = choice.candidates
        positions = logprobs.shape[1]
        trees = []
        for b, depth in enumerate(depths):
            candidates = None if ids is None else ids[b, :depth]
            tree = budget_tree(logprobs[b, :depth], budget, candidates, positions) if depth else DraftTree((), ())
            trees.append(tree)
        return trees

    def accept_tree(self, row: int, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
        # Node i draws with the runtime's uniform i of the step (rand_data_validation), as slot i of a chain does.
        uniforms = torch.rand(self.block, generator=self.generators[row])
        return tree_accept(tree, logits, self.temperatures[row], uniforms)


@dataclass
class _ReferenceRule:
    """Rejection sampling from the drafter's distribution, one generator for the whole batch."""

    sampling: SamplingParams
    generator: torch.Generator
    draft_probs: torch.Tensor | None = None

    def first(self, last_logits: torch.Tensor) -> torch.Tensor:
        return pick_tokens(last_logits, self.sampling, self.generator)

    def draft(self, drafter: DraftModel, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        probs = sampling_probs(drafter.unary_logits(drafter.draft_slots(hidden)), self.sampling)
        probs = drafter.head.target_probs(probs, drafter.spec.vocab_size)
        self.draft_probs = probs
        flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=self.generator)
        return flat.view(probs.shape[:-1])

    def accept(self, row: int, drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
        if len(logits) == 1:
            return 0, int(pick_tokens(logits[0], self.sampling, self.generator))
        assert self.draft_probs is not None  # more than one verified position means the drafts were sampled
        target_probs = sampling_probs(logits, self.sampling)
        return rejection_accept(drafts, self.draft_probs[row, : len(logits) - 1], target_probs, self.generator)


def _accept_rule(
    per_sequence: list[SamplingParams], seed: int, seeds: list[int] | None, block: int, spec: DraftSpec
) -> _AcceptRule:
    sequence_seeds = list(seeds) if seeds is not None else [seed + i for i in range(len(per_sequence))]
    if len(sequence_seeds) != len(per_sequence):
        raise DFlashTrtError(f"got {len(sequence_seeds)} seeds for {len(per_sequence)} prompts")
    if any(p.method == REFERENCE and not p.greedy for p in per_sequence):
        if spec.dflash2 is not None:
            raise DFlashTrtError(
                "the reference sampling method rejection-samples from the drafter's token distribution, which a "
                f"DFlash2 drafter's selector does not give; sample with the engine's method ({ENGINE})"
            )
        return _ReferenceRule(per_sequence[0], torch.Generator().manual_seed(seed))
    generators = [torch.Generator().manual_seed(s) for s in sequence_seeds]
    return _EngineRule(generators, [p.temperature for p in per_sequence], block)


@dataclass
class _Loop:
    """One batched call's state: the model, its two caches, the sequences, and the rules chosen for the call.
    `load` is the number of requests in the previous step (the prefill counts every prompt): as in the engine, it
    sets how many drafts each request verifies in the next step through `schedule` (a tree's node budget when
    `trees` is set: `nodes` at most)."""

    model: GoldenModel
    seqs: list[_Sequence]
    block: int
    rule: _AcceptRule
    stops: frozenset[int]
    target_cache: KVCache
    draft_cache: KVCache
    schedule: DraftLenSchedule = FIXED
    load: int = 0
    trees: _EngineRule | None = None  # set when the step verifies draft trees instead of chains
    nodes: int = 0  # a tree's nodes at most (0: chains)

    def keep(self, seq: _Sequence, new: list[int]) -> int:
        """Append what the budget and the stop tokens let a sequence keep of `new`; returns how many."""
        kept = keep_tokens(new, seq.max_length - len(seq.tokens), self.stops)
        seq.tokens.extend(kept.tokens)
        seq.stopped = kept.stopped
        return len(kept.tokens)


def _prefill(loop: _Loop, prompts: list[list[int]]) -> None:
    """Run the prompts through the target, seed the drafter's context, and pick every sequence's first token."""
    target, draft, batch = loop.model.target, loop.model.draft, len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    tokens = torch.zeros(batch, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    positions = torch.arange(width).expand(batch, -1)
    valid = positions < lengths[:, None]
    logits, taps = target.forward(tokens, positions, valid, loop.target_cache, torch.ones(batch, dtype=torch.bool))
    if loop.block > 1:
        draft.inject(taps, positions, valid, loop.draft_cache)
    first = loop.rule.first(logits[torch.arange(batch), lengths - 1])
    for seq, token in zip(loop.seqs, first.tolist(), strict=True):
        loop.keep(seq, [token])


def drafter_block(drafter: DraftModel, anchors: torch.Tensor, width: int, verify: torch.Tensor):
    """The drafter's input for verify blocks of `width` (`verify` of them checked per sequence): `[anchor, MASK...]`
    with one slot per draft (plus the anchor's, unless the anchor's slot drafts), and which slots are real."""
    spec = drafter.spec
    slots = width - 1 + spec.first_draft_slot
    block = torch.full((len(anchors), slots), spec.mask_token_id, dtype=torch.long)
    block[:, 0] = anchors
    valid = torch.arange(slots) < (verify - 1 + spec.first_draft_slot).clamp(min=1)[:, None]
    return block, valid


def _draft_block(loop: _Loop, start: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """`[anchor, drafts...]` per sequence; the drafter sees the first `width` positions of its block (the whole
    block, but no position past the output budget), whatever the schedule lets the step verify."""
    draft, block = loop.model.draft, loop.block
    anchors = torch.tensor([s.tokens[-1] for s in loop.seqs])
    block_ids = torch.full((len(loop.seqs), block), draft.spec.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = anchors
    if block > 1:
        drafter_ids, valid = drafter_block(draft, anchors, block, width)
        hidden = draft.forward(drafter_ids, start, valid, loop.draft_cache)
        block_ids[:, 1:] = loop.rule.draft(draft, hidden, anchors)[:, : block - 1]
    return block_ids


def _accept(loop: _Loop, block_ids: torch.Tensor, logits: torch.Tensor, verify: torch.Tensor) -> torch.Tensor:
    """Keep each active sequence's accepted drafts plus one target token; returns the mask of the kept positions."""
    produced_mask = torch.zeros(len(loop.seqs), loop.block, dtype=torch.bool)
    for b, seq in enumerate(loop.seqs):
        if not seq.active:
            continue
        v = int(verify[b])
        drafts = block_ids[b, 1:v]
        accepted, bonus = loop.rule.accept(b, drafts, logits[b, :v])
        produced = loop.keep(seq, drafts[:accepted].tolist() + [bonus])
        produced_mask[b, :produced] = True
        seq.result.acceptance_lengths.append(produced)
        emitted = drafts[:accepted].tolist() + [bonus]
        ranks = loop.rule.ranks(b, emitted, len(drafts)) if isinstance(loop.rule, _EngineRule) else None
        seq.result.steps.append(StepTrace(drafts.tolist(), accepted, ranks=ranks))
    return produced_mask


def _draft_trees(
    loop: _Loop, rule: _EngineRule, start: torch.Tensor, verify: torch.Tensor, budget: int
) -> list[DraftTree]:
    """Each sequence's draft tree (or chain) of `budget` nodes over the positions it may still verify (none for a
    finished one)."""
    draft = loop.model.draft
    anchors = torch.tensor([s.tokens[-1] for s in loop.seqs])
    block, valid = drafter_block(draft, anchors, loop.block, verify)
    hidden = draft.forward(block, start, valid, loop.draft_cache)
    return rule.trees(draft, hidden, anchors, [int(v) - 1 for v in verify], budget)


def _tree_rows(loop: _Loop, trees: list[DraftTree], start: torch.Tensor):
    """The verify rows of every tree (anchor first, then the nodes), their RoPE positions (anchor + depth), which
    rows are real, and their layout in the cache (slot = anchor slot + node index, attention along the paths)."""
    width = 1 + max(tree.size for tree in trees)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    depth = torch.zeros(len(trees), width, dtype=torch.long)
    visible = torch.zeros(len(trees), width, width, dtype=torch.bool)
    for b, (seq, tree) in enumerate(zip(loop.seqs, trees, strict=True)):
        n = tree.size + 1
        tokens[b, :n] = torch.tensor([seq.tokens[-1], *tree.tokens])
        depth[b, :n] = torch.tensor(tree.depths())
        visible[b, :n, :n] = tree.visibility()
    valid = torch.arange(width) < torch.tensor([tree.size + 1 for tree in trees])[:, None]
    slots = start[:, None] + torch.arange(width)
    return tokens, start[:, None] + depth, valid, TreeBlock(slots, visible)


def _tree_step(loop: _Loop, rule: _EngineRule, start: torch.Tensor, verify: torch.Tensor, budget: int) -> int:
    """Draft a tree of `budget` nodes (a chain for a budget of at most the block's drafts) per sequence, verify it
    with tree attention, accept the walk's path plus its bonus, move the path's target K/V to consecutive slots (the
    runtime's rewind) and inject the path's features."""
    trees = _draft_trees(loop, rule, start, verify, budget)
    tokens, positions, valid, layout = _tree_rows(loop, trees, start)
    logits, taps = loop.model.target.forward(tokens, positions, valid, loop.target_cache, tree=layout)
    path_rows = torch.zeros(len(loop.seqs), loop.block, dtype=torch.long)
    produced_mask = torch.zeros(len(loop.seqs), loop.block, dtype=torch.bool)
    for b, (seq, tree) in enumerate(zip(loop.seqs, trees, strict=True)):
        if not seq.active:
            continue
        path, bonus = rule.accept_tree(b, tree, logits[b, : tree.size + 1])
        emitted = [tree.tokens[node - 1] for node in path[1:]] + [bonus]
        produced = loop.keep(seq, emitted)
        first = int(start[b])
        loop.target_cache.move(b, [first + node for node in path], [first + i for i in range(len(path))])
        path_rows[b, : len(path)] = torch.tensor(path)
        produced_mask[b, :produced] = True
        seq.result.acceptance_lengths.append(produced)
        positions = int(verify[b]) - 1
        step = StepTrace(
            list(tree.tokens), len(path) - 1, list(tree.parents), rule.ranks(b, emitted, positions), positions
        )
        seq.result.steps.append(step)
    path_taps = taps.gather(1, path_rows[:, :, None].expand(-1, -1, taps.shape[-1]))
    loop.model.draft.inject(path_taps, start[:, None] + torch.arange(loop.block), produced_mask, loop.draft_cache)
    return int(produced_mask.sum())


def _decode_step(loop: _Loop) -> int:
    """Draft, verify and accept one block (or tree) per sequence; returns how many tokens the step produced. Each
    sequence verifies the schedule's draft length for the previous step's load (clipped to its output budget), or
    its tree (the schedule's node budget) over every draft position its output budget leaves."""
    start = torch.tensor([s.start for s in loop.seqs])
    drafts = loop.schedule.draft_len(loop.load, loop.nodes or loop.block - 1)
    # Finished sequences ride along verifying only their anchor; nothing of theirs is kept.
    room = [s.max_length - s.start if s.active else 1 for s in loop.seqs]
    width = torch.tensor([min(loop.block, r) for r in room])
    verify = torch.tensor([min(drafts + 1, r) for r in room])
    loop.load = sum(s.active for s in loop.seqs)
    if loop.trees is not None:
        return _tree_step(loop, loop.trees, start, width, drafts)
    block_ids = _draft_block(loop, start, width)
    block_positions = start[:, None] + torch.arange(loop.block)
    block_valid = torch.arange(loop.block) < verify[:, None]
    logits, taps = loop.model.target.forward(block_ids, block_positions, block_valid, loop.target_cache)
    produced_mask = _accept(loop, block_ids, logits, verify)
    if loop.block > 1:
        loop.model.draft.inject(taps, block_positions, produced_mask, loop.draft_cache)
    return int(produced_mask.sum())


def speculative_generate(
    model: GoldenModel,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    stop_token_ids: list[int] | None = None,
    sampling: SamplingParams | list[SamplingParams] | None = None,
    seed: int = 0,
    block_size: int | None = None,
    seeds: list[int] | None = None,
    progress: Callable[[int], object] | None = None,
    draft_len_schedule: DraftLenSchedule = FIXED,
    draft_tree: int | None = None,
) -> list[SequenceResult]:
    """Generate for every prompt at once; results are identical to running each prompt alone (greedy, or with the
    engine's sampling when each sequence gets the same seed), except that `draft_len_schedule` sets every step's
    draft length from the number of sequences in the previous step, as the engine does. `sampling` may be one
    SamplingParams per prompt (engine method only); `seeds` overrides the per-sequence seeds `seed + i` of the
    engine method. `progress` hears how many tokens each step produced. `draft_tree` N > block - 1 verifies each
    step's best tree of N nodes (reference/tree.py) instead of the chain; N = block - 1 is the chain. With both, the
    schedule's value for a step's load is each request's node budget (at most N; up to block - 1 a chain of that
    many drafts)."""
    per_sequence = per_sequence_sampling(sampling, len(prompts))
    target, draft = model.target, model.draft
    widest = draft.spec.verify_width
    block = widest if block_size is None else block_size
    if not 1 <= block <= widest:
        raise DFlashTrtError(f"block size must be in 1..{widest}, got {block}")
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    _check_prompts(prompts, target.spec.vocab_size, news)
    nodes = draft_tree_nodes(draft_tree, block - 1, draft.spec.dflash2 is not None)
    rule = _accept_rule(per_sequence, seed, seeds, max(block, nodes + 1), draft.spec)
    trees = None
    if nodes:
        if not isinstance(rule, _EngineRule):
            raise DFlashTrtError(f"draft trees are verified with the engine's sampling method ({ENGINE})")
        trees = rule
    seqs = [_Sequence(SequenceResult(list(p)), list(p), len(p) + n) for p, n in zip(prompts, news, strict=True)]
    capacity = max(s.max_length for s in seqs) + max(block, nodes + 1) + 1
    caches = target.new_cache(len(seqs), capacity), draft.new_cache(len(seqs), capacity)
    schedule = draft_len_schedule.fitted_to(nodes or block - 1) if block > 1 else FIXED
    loop = _Loop(model, seqs, block, rule, frozenset(stop_token_ids or []), *caches, schedule, len(seqs), trees, nodes)
    _prefill(loop, prompts)
    if progress is not None:
        progress(len(seqs))
    while any(s.active for s in seqs):
        produced = _decode_step(loop)
        if progress is not None:
            progress(produced)
    for seq in seqs:
        seq.result.output_ids = seq.tokens[len(seq.result.input_ids) :]
    return [s.result for s in seqs]
