"""A reduced draft vocabulary's id map, checked before anything is converted or decoded.

A speculators drafter with `draft_vocab_size` below the target's drafts over its own vocabulary: draft id `i` is
target id `i + d2t[i]` (int64 offsets) and `t2d` marks the target ids it holds. A map that leaves the target's
vocabulary, repeats an id or disagrees with `t2d` would draft tokens the target never meant, so it is refused.
"""

from __future__ import annotations

import numpy as np

from dflash_trt.checkpoint.hf_reader import HFCheckpointReader
from dflash_trt.errors import DFlashTrtError
from dflash_trt.spec import DRAFT_TO_TARGET, TARGET_TO_DRAFT, DraftSpec

MAP_DTYPES = {DRAFT_TO_TARGET: "I64", TARGET_TO_DRAFT: "BOOL"}  # source dtype of each map tensor


def target_ids(offsets: np.ndarray) -> np.ndarray:
    """Target id of every draft id, from speculators' d2t offsets."""
    return np.arange(len(offsets), dtype=np.int64) + offsets.astype(np.int64)


def check_target_ids(ids: np.ndarray, target_vocab_size: int, where: str) -> None:
    """Every draft id maps into the target vocabulary, each target id at most once."""
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size):
        raise DFlashTrtError(f"{where}: the draft vocabulary maps outside the target's {target_vocab_size} tokens")
    if len(np.unique(ids)) != len(ids):
        raise DFlashTrtError(f"{where}: the draft vocabulary maps two draft ids to the same target id")


def check_draft_vocabulary(draft: DraftSpec, reader: HFCheckpointReader) -> None:
    """The drafter's d2t (and t2d, when stored) describe one reduced vocabulary inside the target's."""
    if draft.draft_vocab_size is None:
        return
    where = f"drafter tensor '{DRAFT_TO_TARGET}'"
    offsets = reader.read_rows(DRAFT_TO_TARGET, 0, draft.draft_vocab_size).view("<i8")
    ids = target_ids(offsets)
    check_target_ids(ids, draft.vocab_size, where)
    if TARGET_TO_DRAFT in reader:
        held = reader.read_rows(TARGET_TO_DRAFT, 0, draft.vocab_size).view(np.uint8) != 0
        if int(held.sum()) != len(ids) or not bool(held[ids].all()):
            raise DFlashTrtError(
                f"drafter tensors '{DRAFT_TO_TARGET}' and '{TARGET_TO_DRAFT}' describe different draft vocabularies"
            )
