"""End-to-end build of the embedded pair: corpus → tokenizer → target → drafters (z-lab DFlash, speculators
DFlash2) → metrics → manifest."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from dflash.model import DFlashDraftModel
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from dflash_trt.tiny import corpus, evaluate, models, train
from dflash_trt.tiny.heldout import DFLASH2_DRAFT, HeldoutPrompt
from dflash_trt.tiny.tokenizer import save_tokenizer
from dflash_trt.tiny.train_dflash2 import new_drafter, train_dflash2

# The DFlash2 drafter's mean acceptance length on the held-out prompts, given the pair's folder: measured by the
# caller (the golden model decodes it; this layer cannot import it).
MeasureAcceptance = Callable[[Path], float]


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    train_problems: int = 200_000
    heldout_problems: int = 200
    target_steps: int = 900
    target_batch: int = 64
    target_lr: float = 3e-3
    draft_steps: int = 500
    draft_batch: int = 32
    draft_anchors: int = 16
    draft_gamma: float = 7.0
    draft_lr: float = 2e-3
    dflash2_steps: int = 800
    dflash2_batch: int = 16
    dflash2_anchors: int = 8
    dflash2_lr: float = 2e-3
    threads: int = 1  # on a shared 2-core machine one thread wastes less time waiting than two


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_heldout(path: Path, problems: list[corpus.Problem]) -> list[HeldoutPrompt]:
    prompts = [HeldoutPrompt(text=p.prompt, answer=p.answer) for p in problems]
    with open(path, "w", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps(asdict(prompt)) + "\n")
    return prompts


def _param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_pair(
    out_dir: Path, recipe: Recipe, command: str, measure_dflash2: MeasureAcceptance, log: train.Log = print
) -> dict:
    """Train the target and both drafters into `out_dir/{target,draft,draft_dflash2}` and write heldout.jsonl +
    manifest.json."""
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    target_dir, draft_dir = out_dir / "target", out_dir / "draft"
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)

    train_problems = list(corpus.generate(recipe.seed, recipe.train_problems, heldout=False))
    heldout_problems = list(corpus.generate(recipe.seed + 1, recipe.heldout_problems, heldout=True))
    heldout = write_heldout(out_dir / "heldout.jsonl", heldout_problems)
    tokenizer = save_tokenizer(target_dir)
    encoded = train.encode(train_problems, tokenizer)
    log(f"corpus: {len(train_problems)} problems, {int(encoded.lengths.sum())} tokens")

    target = Qwen3ForCausalLM(models.target_config(tokenizer.eos_token_id, tokenizer.pad_token_id))
    started = time.perf_counter()
    train.train_target(
        target,
        encoded,
        steps=recipe.target_steps,
        batch_size=recipe.target_batch,
        lr=recipe.target_lr,
        seed=recipe.seed,
        log=log,
    )
    target_seconds = time.perf_counter() - started
    accuracy = evaluate.greedy_accuracy(target, tokenizer, heldout)
    log(f"target held-out greedy accuracy {accuracy:.3f} after {target_seconds:.0f}s")
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.generation_config.pad_token_id = tokenizer.pad_token_id
    target.save_pretrained(target_dir)

    draft = DFlashDraftModel(models.draft_config(target.config, tokenizer.mask_token_id))
    started = time.perf_counter()
    train.train_draft(
        draft,
        target,
        encoded,
        steps=recipe.draft_steps,
        batch_size=recipe.draft_batch,
        num_anchors=recipe.draft_anchors,
        gamma=recipe.draft_gamma,
        lr=recipe.draft_lr,
        seed=recipe.seed,
        log=log,
    )
    draft_seconds = time.perf_counter() - started
    runs = evaluate.speculative_runs(draft, target, tokenizer, heldout)
    acceptance = evaluate.per_prompt_mean_acceptance_length(runs)
    log(f"draft mean acceptance length {acceptance:.3f} after {draft_seconds:.0f}s")
    draft.save_pretrained(draft_dir)

    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {
        "command": command,
        "seed": recipe.seed,
        "recipe": asdict(recipe),
        "corpus_sha256": corpus.corpus_sha256(train_problems),
        "corpus_problems": len(train_problems),
        "corpus_tokens": int(encoded.lengths.sum()),
        "files_sha256": {str(p.relative_to(out_dir)): sha256_file(p) for p in files},
        "parameters": {"target": _param_count(target), "draft": _param_count(draft)},
        "train_seconds": {"target": round(target_seconds, 1), "draft": round(draft_seconds, 1)},
        "metrics": {
            "heldout_prompts": len(heldout),
            "target_greedy_accuracy": round(accuracy, 4),
            "mean_acceptance_length": round(acceptance, 4),
            "block_size": draft.block_size,
        },
        "torch_version": torch.__version__,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return add_dflash2_drafter(out_dir, recipe, command, log, measure_dflash2)


def add_dflash2_drafter(
    out_dir: Path, recipe: Recipe, command: str, log: train.Log, measure: MeasureAcceptance
) -> dict:
    """Train the DFlash2 drafter (speculators format) against the pair's target on the same corpus, save it to
    `out_dir/draft_dflash2` and record it in the manifest; `measure` gives its held-out acceptance."""
    torch.set_num_threads(recipe.threads)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir / "target"))
    target = Qwen3ForCausalLM.from_pretrained(str(out_dir / "target"), dtype=torch.float32).eval()
    encoded = train.encode(list(corpus.generate(recipe.seed, recipe.train_problems, heldout=False)), tokenizer)
    draft = new_drafter(target, tokenizer.mask_token_id)
    started = time.perf_counter()
    train_dflash2(
        draft,
        target,
        encoded,
        steps=recipe.dflash2_steps,
        batch_size=recipe.dflash2_batch,
        anchors_per_row=recipe.dflash2_anchors,
        lr=recipe.dflash2_lr,
        seed=recipe.seed,
        log=log,
    )
    seconds = time.perf_counter() - started
    draft.save_pretrained(out_dir / DFLASH2_DRAFT)
    # save_pretrained also copies speculators' config class source for remote-code loaders: not checkpoint data.
    (out_dir / DFLASH2_DRAFT / "config.py").unlink(missing_ok=True)
    acceptance = measure(out_dir)
    log(f"dflash2 mean acceptance length {acceptance:.3f} after {seconds:.0f}s")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    manifest["recipe"] = asdict(recipe)
    manifest["dflash2_command"] = command
    for path in sorted(p for p in (out_dir / DFLASH2_DRAFT).rglob("*") if p.is_file()):
        manifest["files_sha256"][str(path.relative_to(out_dir))] = sha256_file(path)
    manifest["parameters"]["dflash2"] = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    manifest["train_seconds"]["dflash2"] = round(seconds, 1)
    manifest["metrics"]["dflash2_mean_acceptance_length"] = round(acceptance, 4)
    manifest["metrics"]["dflash2_block_size"] = draft.block_size
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
