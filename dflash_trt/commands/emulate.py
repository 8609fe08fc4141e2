"""`dflash-trt emulate`: decode through the engine network (`dflash_trt/trtllm/model.py`) on a CPU.

The unmodified network runs under the emulated TensorRT-LLM 1.2.x API and EAGLE runtime loop
(`dflash_trt.emulation`): in-flight batching, chunked prompts, a paged KV pool. At --temperature > 0 the network
verifies the drafts by sampling, with the uniforms the golden loop draws (sequence i from seed + i). The output has
`generate`'s JSON schema.

What it reports is the engine's decoding, which differs from `generate` near --max_new_tokens: the engine (like
TensorRT-LLM's EAGLE runtime) always drafts and verifies a full block (under --draft_len_schedule, the schedule's
draft length for the previous step's load) and clips what it accepts to the budget,
where `generate`'s golden loop verifies a shorter last block. So the output equals the first N tokens of `generate`
run with --max_new_tokens N + block_size - 1 (the same flags otherwise), and each acceptance length is that run's,
the last one clipped to N; `generate` with --max_new_tokens N gives the same tokens at temperature 0 but may give
other acceptance lengths once fewer than block_size - 1 tokens of the budget remain.

`--draft_tree N` runs the network built with draft trees of N nodes (`dflash-trt build --draft_tree N`): each step it
drafts the tree, the emulated runtime verifies it with the packed mask and position offsets of its paths and
rewinds the K/V along the accepted path, as `generate --draft_tree N` decodes. With --draft_len_schedule the
schedule's values are node budgets (up to N; up to block_size - 1 the chain of that many drafts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dflash_trt.commands.generate import check_lengths, sequence_record
from dflash_trt.commands.schedule_flags import add_schedule_arguments, schedule_for_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.gpu_targets import GPU_SMS, resolve_gpu
from dflash_trt.inputs import DRAFT_TREE, POSITIVE_INT, SEED, TEMPERATURE, IntRange
from dflash_trt.prompts import read_prompts
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.sampling_rules import Sampling, SamplingRefused
from dflash_trt.tokenizer import load_tokenizer
from dflash_trt.trtllm.build_limits import MAX_EAGLE_BATCH_SIZE, TOKENS_PER_BLOCK, XQA_TOKENS_PER_BLOCK
from dflash_trt.trtllm.build_settings import EngineBuildSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "emulate",
        help="decode through the engine network under an emulated TensorRT-LLM 1.2.x (CPU)",
        description=__doc__,
    )
    parser.add_argument("--checkpoint_dir", required=True, help="converted checkpoint (dflash-trt convert), tp 1")
    parser.add_argument("--input_file", required=True, help="jsonl prompts")
    parser.add_argument("--max_new_tokens", type=POSITIVE_INT, default=64)
    parser.add_argument(
        "--max_batch_size",
        type=IntRange(1, MAX_EAGLE_BATCH_SIZE),
        default=None,
        help="requests in flight at once (default: the emulated engine's; at most the EAGLE engines' limit)",
    )
    parser.add_argument(
        "--max_num_tokens",
        type=POSITIVE_INT,
        default=None,
        help=f"tokens per step; longer prompts are chunked (default {EngineBuildSettings.max_num_tokens})",
    )
    parser.add_argument(
        "--tokens_per_block",
        type=int,
        choices=XQA_TOKENS_PER_BLOCK,
        default=TOKENS_PER_BLOCK,
        help="paged KV block size (the sizes an engine builds with)",
    )
    parser.add_argument(
        "--gpu",
        choices=tuple(GPU_SMS),
        default=None,
        help="run the network as built for this GPU, whose attention kernels differ, and price --draft_len_schedule "
        "auto for it (default: this host's GPU, "
        "else the one build assumes)",
    )
    parser.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=SEED, default=0, help="sequence i draws from seed + i, as generate")
    parser.add_argument(
        "--draft_tree",
        type=DRAFT_TREE,
        default=None,
        metavar="N",
        help="the engine verifies a draft tree of N nodes each step (default: the chain, N = block_size - 1)",
    )
    parser.add_argument("--ignore_eos", action="store_true", help="never stop before --max_new_tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_schedule_arguments(parser, "none", gpu_flag=False)
    parser.set_defaults(func=run)


def sequence_sampling(args: argparse.Namespace, count: int) -> list[Sampling]:
    """The command line's sampling, normalised once: sequence i at --temperature with seed --seed + i."""
    try:
        return [Sampling(temperature=args.temperature, seed=args.seed + i) for i in range(count)]
    except SamplingRefused as exc:
        raise DFlashTrtError(f"--seed {args.seed} plus the index of each of {count} prompts: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from dflash_trt.emulation.engine import DEFAULT_MAX_BATCH_SIZE, EmulatedEngine
    from dflash_trt.executors.emulated import decode_batch
    from dflash_trt.reference.stats import mean_acceptance_length, per_position_acceptance

    checkpoint_dir = Path(args.checkpoint_dir)
    gpu, chosen = resolve_gpu(args.gpu)
    batch = args.max_batch_size or DEFAULT_MAX_BATCH_SIZE
    schedule = schedule_for_checkpoint(args, checkpoint_dir, batch, gpu_flag=False)
    engine = EmulatedEngine(
        checkpoint_dir,
        batch,
        args.max_num_tokens,
        args.tokens_per_block,
        gpu,
        draft_len_schedule=schedule,
        draft_tree=args.draft_tree,
    )
    tokenizer = load_tokenizer(checkpoint_dir)
    prompts = read_prompts(args.input_file, tokenizer)
    longest = longest_request(engine.facts.max_position_embeddings, engine.depth)
    check_lengths(args, prompts, longest, "the target's max_position_embeddings less two draft blocks")
    sampling = sequence_sampling(args, len(prompts))
    stop_ids = [] if args.ignore_eos else list(engine.eos_token_ids)
    started = time.perf_counter()
    results = decode_batch(engine, prompts, args.max_new_tokens, stop_ids, sampling=sampling)
    seconds = time.perf_counter() - started
    generated = sum(len(r.output_ids) for r in results)
    sequences = [sequence_record(r, tokenizer, False) for r in results]
    report = {
        "sequences": sequences,
        "mean_acceptance_length": mean_acceptance_length(results),
        "per_position_acceptance": per_position_acceptance(results, engine.depth),
        "generated_tokens": generated,
        "tokens_per_second": generated / seconds if seconds > 0 else None,
        "engine_steps": engine.stats.steps,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    for i, record in enumerate(sequences):
        shown = record.get("output_text", record["output_ids"])
        print(f"[{i}] {shown!r}  acceptance {record['acceptance_lengths']}")
    print(
        f"mean acceptance length {report['mean_acceptance_length']:.2f}, {generated} tokens in "
        f"{engine.stats.steps} engine steps, {seconds:.2f} s; the network as built for {gpu} ({chosen})"
    )
    return 0
