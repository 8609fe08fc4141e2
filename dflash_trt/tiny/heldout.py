"""Held-out prompts of the embedded tiny pair and the answer check the demo and tests share."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

ANSWER_PATTERN = re.compile(r"^ans (\d+)$", re.MULTILINE)
DFLASH2_DRAFT = "draft_dflash2"  # the DFlash2 drafter (speculators format), beside the z-lab DFlash `draft`


@dataclass(frozen=True)
class HeldoutPrompt:
    text: str
    answer: str


def asset_dir() -> Path:
    """Directory holding the committed pair: target/, draft/, draft_dflash2/, heldout.jsonl, manifest.json."""
    return Path(str(resources.files("dflash_trt") / "assets" / "tiny_pair"))


def target_dir() -> Path:
    return asset_dir() / "target"


def draft_dir() -> Path:
    return asset_dir() / "draft"


def dflash2_draft_dir() -> Path:
    return asset_dir() / DFLASH2_DRAFT


def load_heldout(path: Path | None = None, limit: int | None = None) -> list[HeldoutPrompt]:
    """Prompts never seen in training, one `{"text", "answer"}` object per line."""
    path = asset_dir() / "heldout.jsonl" if path is None else path
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                prompts.append(HeldoutPrompt(text=record["text"], answer=record["answer"]))
    return prompts[:limit]


def heldout_count() -> int:
    """How many held-out prompts there are (what `demo --num_prompts` may ask for)."""
    return len(load_heldout())


def extract_answer(completion: str) -> str | None:
    """The number on the first `ans N` line of a completion, or None when the model never wrote one."""
    match = ANSWER_PATTERN.search(completion)
    return match.group(1) if match else None


def is_correct(completion: str, answer: str) -> bool:
    return extract_answer(completion) == answer
