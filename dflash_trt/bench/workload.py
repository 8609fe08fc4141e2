"""The requests a benchmark sends: a jsonl prompt file, or synthetic token prompts of controlled lengths.

Synthetic prompts (`ISL,OSL,COUNT`, as trtllm-bench's dataset tool makes them) are uniform random token ids drawn
with a fixed seed; their requests ignore end tokens so every one produces exactly OSL tokens. Prompt files stop at
the model's end tokens, like `dflash-trt generate`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import Request
from dflash_trt.inputs import MAX_REQUESTS, check_fits_in_memory
from dflash_trt.prompts import read_prompts

# Prompt and output tokens of one workload, all requests together: each token is held as a Python int (prompts)
# and a timestamp (responses). It bounds the memory a run grows to before its first point completes.
MAX_WORKLOAD_TOKENS = 50_000_000
BYTES_PER_TOKEN = 64
# The longest sequence a synthetic request may ask for before any model says what it allows.
MAX_SEQUENCE = 1 << 22
MODEL_POSITIONS = "the target's max_position_embeddings less two draft blocks"
# Shipped real-text prompts (math, code, chat, several languages; written for this project), for sweeps.
REAL_PROMPTS = "build_configs/calibration.jsonl"
SYNTHETIC_WARNING = (
    "warning: synthetic prompts are random token ids; a drafter accepts almost none of its drafts on them "
    "(acceptance near 1 instead of several tokens per step on real text), so speculative speedups measured on "
    f"them are far too low. Measure DFlash on real prompts, e.g. {REAL_PROMPTS} in the repository "
    "(bench --input_file, or a sweep config's dataset:)."
)


@dataclass(frozen=True)
class Synthetic:
    input_len: int
    output_len: int
    count: int


@dataclass(frozen=True)
class Workload:
    """The requests of a run; request i asks for prompt `prompt_indices[i]` of the set (by default its position)."""

    requests: list[Request]
    ignore_eos: bool
    description: dict[str, Any]
    prompt_indices: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_indices:
            object.__setattr__(self, "prompt_indices", list(range(len(self.requests))))

    @property
    def max_seq_len(self) -> int:
        return max(len(r.input_ids) + r.max_new_tokens for r in self.requests)

    def resized(self, count: int) -> Workload:
        """`count` requests, cycling through the prompts (a longer run, or a subset, of the same set)."""
        if not 1 <= count <= MAX_REQUESTS:
            raise DFlashTrtError(f"the number of requests must be in [1, {MAX_REQUESTS}], got {count}")
        per_cycle = sum(len(r.input_ids) + r.max_new_tokens for r in self.requests)
        check_workload_tokens(per_cycle * count // len(self.requests), "--num_requests")
        positions = [i % len(self.requests) for i in range(count)]
        return Workload(
            requests=[self.requests[i] for i in positions],
            ignore_eos=self.ignore_eos,
            description=self.description | {"num_requests": count},
            prompt_indices=[self.prompt_indices[i] for i in positions],
        )


def check_request_length(prompt_len: int, new_tokens: int, max_positions: int, where: str) -> None:
    if prompt_len + new_tokens > max_positions:
        raise DFlashTrtError(
            f"a request of {prompt_len} prompt + {new_tokens} output tokens exceeds {where} ({max_positions}); "
            "shorten the prompts (ISL) or ask for fewer tokens (OSL, --max_new_tokens)"
        )


def check_workload_tokens(tokens: int, what: str) -> None:
    """A run's prompts and outputs must fit the token bound and this machine's free memory."""
    if tokens > MAX_WORKLOAD_TOKENS:
        raise DFlashTrtError(
            f"{what} asks for {tokens} prompt and output tokens in all; a run holds at most {MAX_WORKLOAD_TOKENS} "
            "(fewer or shorter requests)"
        )
    check_fits_in_memory(tokens * BYTES_PER_TOKEN, f"{what}'s requests and their timings", "fewer or shorter requests")


def parse_synthetic(text: str) -> Synthetic:
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    limits = (MAX_SEQUENCE, MAX_SEQUENCE, MAX_REQUESTS)
    if len(values) != 3 or not all(1 <= v <= limit for v, limit in zip(values, limits, strict=True)):
        raise DFlashTrtError(
            f"--synthetic must be ISL,OSL,COUNT with ISL and OSL in [1, {MAX_SEQUENCE}] and COUNT in "
            f"[1, {MAX_REQUESTS}], got {text[:60]!r}"
        )
    spec = Synthetic(*values)
    check_workload_tokens((spec.input_len + spec.output_len) * spec.count, "--synthetic")
    return spec


def synthetic_workload(spec: Synthetic, vocab_size: int, seed: int = 0, max_positions: int | None = None) -> Workload:
    """`max_positions`: the longest request the model serves, checked before any prompt is drawn."""
    if max_positions is not None:
        check_request_length(spec.input_len, spec.output_len, max_positions, MODEL_POSITIONS)
    rng = random.Random(seed)
    requests = [
        Request(input_ids=[rng.randrange(vocab_size) for _ in range(spec.input_len)], max_new_tokens=spec.output_len)
        for _ in range(spec.count)
    ]
    description = {
        "kind": "synthetic",
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "count": spec.count,
        "vocab_size": vocab_size,
        "seed": seed,
    }
    return Workload(requests=requests, ignore_eos=True, description=description)


def file_workload(
    path: str | Path,
    max_new_tokens: int,
    tokenizer=None,
    limit: int | None = None,
    chat_kwargs: dict[str, Any] | None = None,
    max_positions: int | None = None,
) -> Workload:
    if max_new_tokens < 1:
        raise DFlashTrtError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_positions is not None and max_new_tokens >= max_positions:
        check_request_length(1, max_new_tokens, max_positions, MODEL_POSITIONS)
    prompts = read_prompts(path, tokenizer, limit, chat_kwargs)
    if max_positions is not None:
        longest = max(len(ids) for ids in prompts)
        check_request_length(longest, max_new_tokens, max_positions, MODEL_POSITIONS)
    check_workload_tokens(sum(len(ids) + max_new_tokens for ids in prompts), f"the prompts of {path}")
    requests = [Request(input_ids=ids, max_new_tokens=max_new_tokens) for ids in prompts]
    description = {
        "kind": "file",
        "path": str(Path(path).resolve()),
        "count": len(requests),
        "max_new_tokens": max_new_tokens,
    }
    if chat_kwargs is not None:
        description["chat_template_kwargs"] = chat_kwargs
    return Workload(requests=requests, ignore_eos=False, description=description)
