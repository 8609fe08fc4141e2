"""How many drafts each request verifies, as a function of the step's load: the draft-length schedule.

Verification costs `K + 1` target tokens per request. At a small batch every pass is bound by reading the weights
and a long draft is nearly free; at a large one the verify GEMMs turn compute-bound and the last drafts, accepted
ever more rarely, cost more than they return. A schedule fixed at build time lets the engine shorten the draft as
the batch grows: with at least `N` requests in a step, each request's next draft is `K` tokens. The load is the
number of requests in the step (context and generation alike: each of them verifies its drafts in the next step).
Below the first threshold, and with no steps at all (`none`), the engine drafts its full `max_draft_len`.

One contract for chains and trees: a schedule's value is the number of drafts each request verifies in a step, at
most the engine's `max_draft_len` (`fitted_to`). A chain engine of block `K + 1` takes values up to `K`. A draft-tree
engine of at most `N` nodes over `K` positions takes values up to `N` and reads a value `B` as the request's node
budget: `B <= K` is the chain of the block's first `B` best tokens, `B > K` the best tree of `B` nodes
(`reference/tree.py` `budget_tree`). So a tree engine verifies wide trees at small loads, where the step is bound by
reading the weights, and the chain (or less) at large ones, where the verify GEMMs are compute-bound.

One schedule drives everything that decodes: the engine network (`trtllm/model.py` computes `next_draft_lens`
from it), the golden loop and both CPU executors (draft trees: the emulated one, which runs the network), and the
planner that derives `auto` (`analysis/draft_schedule.py`). User text (`auto`, `none`, `N1:K1,N2:K2,...`) is
parsed and checked in `inputs.py` (`DRAFT_LEN_SCHEDULE`), with every other typed value.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.errors import DFlashTrtError

AUTO = "auto"  # derived by the planner for the build's GPU, TP, quantization and the drafter's acceptance
NONE = "none"  # always the engine's full draft length
# Steps a schedule may hold: the engine evaluates one comparison per step, and a draft length only falls.
MAX_STEPS = 64


@dataclass(frozen=True)
class DraftLenSchedule:
    """`steps` = ((min_requests, draft_len), ...): thresholds strictly ascending, draft lengths non-increasing."""

    steps: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        loads = [n for n, _ in self.steps]
        lengths = [k for _, k in self.steps]
        if len(self.steps) > MAX_STEPS:
            raise DFlashTrtError(f"a draft-length schedule holds at most {MAX_STEPS} steps, got {len(self.steps)}")
        if any(n < 1 for n in loads) or any(k < 1 for k in lengths):
            raise DFlashTrtError(f"draft-length schedule {self.text()}: request counts and draft lengths must be >= 1")
        if any(b <= a for a, b in zip(loads, loads[1:], strict=False)):
            raise DFlashTrtError(f"draft-length schedule {self.text()}: request counts must be strictly ascending")
        if any(b > a for a, b in zip(lengths, lengths[1:], strict=False)):
            raise DFlashTrtError(f"draft-length schedule {self.text()}: draft lengths must not increase with the load")

    @property
    def is_none(self) -> bool:
        return not self.steps

    def draft_len(self, load: int, max_draft_len: int) -> int:
        """Drafts each request of a step with `load` requests verifies in the next step (on a tree engine its node
        budget); `max_draft_len` (a chain's K, a tree's N) below the first threshold."""
        chosen = max_draft_len
        for n, k in self.steps:
            if load >= n:
                chosen = k
        return chosen

    def text(self) -> str:
        """`none`, or `N1:K1,N2:K2,...` as `--draft_len_schedule` takes it."""
        return ",".join(f"{n}:{k}" for n, k in self.steps) if self.steps else NONE

    def fitted_to(self, max_draft_len: int, what: str = "--draft_len_schedule") -> DraftLenSchedule:
        """This schedule for an engine verifying at most `max_draft_len` drafts per request (a chain's block size -
        1, a draft tree's nodes); refuses a longer draft, which the engine could not propose."""
        longest = max((k for _, k in self.steps), default=0)
        if longest > max_draft_len:
            raise DFlashTrtError(
                f"{what} {self.text()} verifies {longest} drafts per request but the engine verifies at most "
                f"{max_draft_len} (block_size - 1, or the draft tree's nodes)"
            )
        return self

    def as_json(self) -> list[list[int]]:
        return [[n, k] for n, k in self.steps]


FIXED = DraftLenSchedule()  # `none`: every step drafts the engine's full length
