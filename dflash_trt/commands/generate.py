"""`dflash-trt generate`: speculative decoding of a converted checkpoint with the torch golden model.

Each input line is `{"input_ids": [...]}` or, when the checkpoint directory holds a tokenizer, `{"text": "..."}`.
Stops at the target's EOS ids unless `--stop_token_ids` or `--ignore_eos` say otherwise. At --temperature > 0 the
default `--sampling engine` is the engine's rule (argmax drafts, one target sample per verified position, accepted
while it equals the draft; temperature only, like the engine); `--sampling reference` is dflash_generate's rejection
sampling of sampled drafts (honours --top_p / --top_k). Both reproduce the target's distribution exactly.

`--draft_tree N` (N > block_size - 1) verifies, each step, the tree of N drafted tokens holding the block's most
likely continuations under the drafter's per-position distributions, with tree attention; the target draws one token
per node and the walk descends to the child holding it (lossless at temperature 0, the target's law above). N =
block_size - 1 is the chain. With --draft_len_schedule the schedule's values are node budgets (up to N; up to
block_size - 1 the chain of that many drafts), as a tree engine reads them.

Near --max_new_tokens this golden loop verifies only the tokens the budget still allows (a shorter last block,
drafted as such); an engine drafts a full block and clips (see `dflash-trt emulate --help`), so the two agree on
tokens at temperature 0 but may differ in the last acceptance lengths.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from dflash_trt.commands.schedule_flags import add_schedule_arguments, schedule_for_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import DRAFT_TREE, POSITIVE_INT, SEED, TEMPERATURE, TOKEN_ID, TOP_K, TOP_P
from dflash_trt.jsonfile import strict_json
from dflash_trt.prompts import CHAT_TEMPLATE_KWARGS_HELP, parse_chat_template_kwargs, read_prompts
from dflash_trt.sampling_rules import ENGINE, METHODS
from dflash_trt.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from dflash_trt.reference.decode import SequenceResult, StepTrace


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="speculative decoding of a converted checkpoint (CPU golden model)", description=__doc__
    )
    parser.add_argument("--checkpoint_dir", required=True, help="converted checkpoint (dflash-trt convert)")
    parser.add_argument(
        "--input_file", required=True, help='jsonl prompts: {"text"}, {"input_ids"} or {"messages"} per line'
    )
    parser.add_argument("--chat_template_kwargs", default=None, help=CHAT_TEMPLATE_KWARGS_HELP)
    parser.add_argument("--max_new_tokens", type=POSITIVE_INT, default=64)
    parser.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top_p", type=TOP_P, default=1.0, help="--sampling reference only")
    parser.add_argument("--top_k", type=TOP_K, default=0, help="--sampling reference only")
    parser.add_argument(
        "--sampling",
        choices=METHODS,
        default=ENGINE,
        help="rule at temperature > 0: the engine's (default) or dflash_generate's",
    )
    parser.add_argument("--seed", type=SEED, default=0, help="sequence i draws from seed + i (engine rule)")
    parser.add_argument("--block_size", type=POSITIVE_INT, default=None, help="verify block (default: the drafter's)")
    parser.add_argument(
        "--draft_tree",
        type=DRAFT_TREE,
        default=None,
        metavar="N",
        help="verify a draft tree of N nodes each step (default: the chain, N = block_size - 1)",
    )
    stops = parser.add_mutually_exclusive_group()
    stops.add_argument(
        "--stop_token_ids", type=TOKEN_ID, nargs="+", default=None, help="replace the EOS stop ids (token ids)"
    )
    stops.add_argument("--ignore_eos", action="store_true", help="never stop before --max_new_tokens")
    parser.add_argument("--trace", action="store_true", help="record the drafted tokens of every step")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_schedule_arguments(parser, "none (auto is derived for the prompts given, all in one batch)")
    parser.set_defaults(func=run)


def sequence_record(result: SequenceResult, tokenizer, trace: bool) -> dict[str, Any]:
    record: dict[str, Any] = {
        "input_ids": result.input_ids,
        "output_ids": result.output_ids,
        "acceptance_lengths": result.acceptance_lengths,
    }
    if tokenizer is not None:
        record["output_text"] = tokenizer.decode(result.output_ids)
    if trace:
        record["steps"] = [step_record(s) for s in result.steps]
    return record


def step_record(step: StepTrace) -> dict[str, Any]:
    """A traced step: its drafts and accepted count, and for a tree each node's parent (0 = the anchor)."""
    record: dict[str, Any] = {"draft_ids": step.draft_ids, "accepted": step.accepted}
    if step.parents is not None:
        record["parents"] = step.parents
    return record


def check_lengths(
    args: argparse.Namespace, prompts: list[list[int]], limit: int, what: str = "the target's max_position_embeddings"
) -> None:
    """Positions past what the model was trained for decode garbage, and a huge request fails allocating."""
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > limit:
        raise DFlashTrtError(
            f"the longest prompt ({longest} tokens) plus --max_new_tokens {args.max_new_tokens} exceeds {what} "
            f"({limit}); shorten the prompts or ask for fewer tokens"
        )


def _print_trace(record: dict) -> None:
    for number, step in enumerate(record["steps"]):
        tree = f" (parents {step['parents']})" if "parents" in step else ""
        print(f"    step {number}: drafted {step['draft_ids']}{tree}, accepted {step['accepted']}")


def run(args: argparse.Namespace) -> int:
    from dflash_trt.reference.decode import per_sequence_sampling, speculative_generate
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.reference.sampling import SamplingParams
    from dflash_trt.reference.stats import (
        REPORTED_RANKS,
        mean_acceptance_length,
        per_position_acceptance,
        per_position_rank_rates,
    )

    checkpoint_dir = Path(args.checkpoint_dir)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.sampling)
    per_sequence_sampling(sampling, 1)  # refuse what the chosen rule cannot honour before loading anything
    chat_kwargs = parse_chat_template_kwargs(args.chat_template_kwargs)
    model = load_golden_model(checkpoint_dir)
    tokenizer = load_tokenizer(checkpoint_dir)
    prompts = read_prompts(args.input_file, tokenizer, chat_kwargs=chat_kwargs)
    check_lengths(args, prompts, model.target.spec.max_position_embeddings)
    schedule = schedule_for_checkpoint(args, checkpoint_dir, len(prompts))
    if args.ignore_eos:
        stop_ids = []
    elif args.stop_token_ids is not None:
        stop_ids = args.stop_token_ids
        vocab = model.target.spec.vocab_size
        if max(stop_ids) >= vocab:
            raise DFlashTrtError(
                f"--stop_token_ids must be token ids in [0, {vocab - 1}] (the target's vocabulary), got {max(stop_ids)}"
            )
    else:
        stop_ids = list(model.target.spec.eos_token_ids)
    started = time.perf_counter()
    total = args.max_new_tokens * len(prompts)
    with tqdm(total=total, desc="generate", unit="token", disable=not sys.stderr.isatty()) as bar:
        results = speculative_generate(
            model,
            prompts,
            args.max_new_tokens,
            stop_ids,
            sampling,
            args.seed,
            args.block_size,
            progress=bar.update,
            draft_tree=args.draft_tree,
            draft_len_schedule=schedule,
        )
    seconds = time.perf_counter() - started
    generated = sum(len(r.output_ids) for r in results)
    report: dict[str, Any] = {
        "sequences": [sequence_record(r, tokenizer, args.trace) for r in results],
        "mean_acceptance_length": mean_acceptance_length(results),
        "per_position_acceptance": per_position_acceptance(results, model.draft.spec.num_drafts),
        "per_position_rank_rates": per_position_rank_rates(results, model.draft.spec.num_drafts, REPORTED_RANKS),
        "generated_tokens": generated,
        "tokens_per_second": generated / seconds if seconds > 0 else None,
    }
    if args.json:
        print(strict_json(report))
        return 0
    for i, record in enumerate(report["sequences"]):
        shown = record.get("output_text", record["output_ids"])
        print(f"[{i}] {shown!r}  acceptance {record['acceptance_lengths']}")
        if args.trace:
            _print_trace(record)
    print(f"mean acceptance length {report['mean_acceptance_length']:.2f}, {generated} tokens in {seconds:.2f} s")
    return 0
