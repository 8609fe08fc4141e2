"""Train the embedded tiny target + its two drafters on the CPU (35-50 minutes, one core): the z-lab-format DFlash
drafter and the speculators-format DFlash2 drafter, both on the same corpus.

nice -n 10 python perf/train_tiny_pair.py --output_dir dflash_trt/assets/tiny_pair
nice -n 10 python perf/train_tiny_pair.py --output_dir dflash_trt/assets/tiny_pair --dflash2_only   # 5-15 minutes

`--dflash2_only` trains only the DFlash2 drafter, against the pair's committed target. The DFlash2 drafter's
held-out acceptance is measured by converting it with the target and decoding with the golden model.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import tempfile
from pathlib import Path

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.reference.decode import speculative_generate
from dflash_trt.reference.model import load_golden_model
from dflash_trt.tiny.build import Recipe, add_dflash2_drafter, build_pair
from dflash_trt.tiny.evaluate import MAX_NEW_TOKENS
from dflash_trt.tiny.heldout import DFLASH2_DRAFT, load_heldout
from dflash_trt.tokenizer import load_tokenizer


def dflash2_acceptance(pair_dir: Path) -> float:
    """Mean over held-out prompts of each prompt's mean acceptance length (the v1 drafter's convention)."""
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "checkpoint"
        convert_checkpoint(pair_dir / "target", pair_dir / DFLASH2_DRAFT, checkpoint, dtype="float32")
        model = load_golden_model(checkpoint)
        tokenizer = load_tokenizer(checkpoint)
        prompts = [tokenizer.encode(p.text) for p in load_heldout(pair_dir / "heldout.jsonl")]
        results = speculative_generate(model, prompts, MAX_NEW_TOKENS, list(model.target.spec.eos_token_ids))
    means = [sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in results if r.acceptance_lengths]
    return sum(means) / len(means)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=Path("dflash_trt/assets/tiny_pair"))
    parser.add_argument("--dflash2_only", action="store_true", help="add the DFlash2 drafter to an existing pair")
    for field in dataclasses.fields(Recipe):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    args = parser.parse_args()
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    command = shlex.join(["python", "perf/train_tiny_pair.py", *sys.argv[1:]])

    def log(line: str) -> None:
        print(line, flush=True)

    if args.dflash2_only:
        manifest = add_dflash2_drafter(args.output_dir, recipe, command, log, dflash2_acceptance)
    else:
        manifest = build_pair(args.output_dir, recipe, command, dflash2_acceptance, log)
    print(manifest["metrics"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
