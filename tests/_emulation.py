"""Shared pieces of the emulation tests (dense and mixture-of-experts): fixture prompts, conversion of a random
pair, and the sampled comparison of the emulated engine with the golden loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _pairs import PairVariant, make_pair

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.emulation.engine import EmulatedEngine
from dflash_trt.executors.emulated import decode_batch
from dflash_trt.reference.decode import SequenceResult, speculative_generate
from dflash_trt.reference.divergence import compare_decodings, failures
from dflash_trt.reference.model import load_golden_model
from dflash_trt.reference.sampling import SamplingParams
from dflash_trt.sampling_rules import Sampling

PROMPTS = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22, 23]]
STOP = [1]  # the fixture targets' eos


def convert(root: Path, variant: PairVariant, **kwargs) -> Path:
    make_pair(root, variant)
    convert_checkpoint(root / "target", root / "draft", root / "ckpt", dtype="float32", **kwargs)
    return root / "ckpt"


def divergences(
    ckpt: Path,
    golden: list[SequenceResult],
    emulated: list[SequenceResult],
    max_new_tokens: int,
    temperatures: list[float] | None = None,
) -> list[str]:
    """The emulation's first divergences from the golden loop that are not near-ties (`reference/divergence.py`).

    The golden loop may have run K tokens further: near its budget it verifies a shortened block, which drafts and
    accepts differently, so given K more it verifies a full block wherever the engine does. Labelled near-ties are
    printed (pytest shows them on a failure) and allowed.
    """
    found = compare_decodings(load_golden_model(ckpt), golden, emulated, max_new_tokens, temperatures)
    for divergence in found:
        if divergence.near_tie:
            print(divergence)
    return [str(d) for d in failures(found)]


# One temperature for the batch, and a mixed batch (greedy and two sampled temperatures, cycled over the prompts).
SAMPLED = {"t0.7": [0.7], "mixed": [0.0, 0.9, 1.3]}
SAMPLED_TOKENS = 20


def per_request(setting: str, count: int) -> list[float]:
    temperatures = SAMPLED[setting]
    return [temperatures[i % len(temperatures)] for i in range(count)]


def sampled_runs(ckpt: Path, prompts: list[list[int]], setting: str, **runtime) -> tuple[list, list, list]:
    """(greedy golden, sampled golden with K more tokens, sampled emulation): per-sequence seeds 40 + i on both
    sides; two slots, so later requests reuse a slot and see its stale uniforms in their context steps."""
    temperatures = per_request(setting, len(prompts))
    sampling = [SamplingParams(t) for t in temperatures]
    seeds = [40 + i for i in range(len(prompts))]
    model = load_golden_model(ckpt)
    k = model.draft.spec.num_drafts
    greedy = speculative_generate(model, prompts, SAMPLED_TOKENS, STOP)
    golden = speculative_generate(model, prompts, SAMPLED_TOKENS + k, STOP, sampling, seeds=seeds)
    engine = EmulatedEngine(ckpt, max_batch_size=2, **runtime)
    at = [Sampling(temperature=t, seed=s) for t, s in zip(temperatures, seeds, strict=True)]
    emulated = decode_batch(engine, prompts, SAMPLED_TOKENS, STOP, sampling=at)
    return greedy, golden, emulated


def record_steps(engine: EmulatedEngine) -> list[dict[str, Any]]:
    """Every engine step's load, its `draft_lens` input and its `next_draft_lens` output, as the runtime binds them."""
    steps: list[dict[str, Any]] = []
    run = engine.run

    def recorded(inputs: dict[str, Any], batch_size: int) -> dict[str, torch.Tensor]:
        outputs = run(inputs, batch_size)
        steps.append(
            {
                "load": batch_size,
                "draft_lens": inputs["draft_lens"].data.tolist(),
                "next": outputs["next_draft_lens"].tolist(),
            }
        )
        return outputs

    engine.run = recorded  # type: ignore[method-assign]
    return steps
