"""`dflash-trt selftest`: prove on this GPU host that the DFlash engine decodes exactly like the golden model.

Converts the embedded tiny trained pair, widened by default to the head size production models use (128; the kernels
are specialised per head size: `dflash_trt/tiny/widen.py`), builds its engine with TensorRT-LLM 1.2.x (plugin
library required), checks the engine's own config.json against what the plan recorded, runs
held-out prompts through the executor in EAGLE mode (all in flight at once, streamed, one response per decoding
iteration: `dflash_trt.bench`) and through the golden model, and fails unless every token and every acceptance
length both define the same way agree, up to labelled near-ties (a first divergence where the golden model's
top-2 logit margin is inside the engine dtype's resolution: `reference/divergence.py`); then a short
concurrency-1 run of the same load generator reports the engine's speed and acceptance. Greedy decoding:
temperature 0 is sent explicitly, since a request without one is sampled at the runtime's default temperature of
1.0.

The engine is built for this host's GPU, so it runs the attention route that GPU needs (docs/engine.md §13): on
B200 / B300 the target's verification and the draft block on DFlashAttention, on H100 / H200 the stock plugin.
`--sliding_window N` gives the drafter's last layer a window of N positions (the golden model applies it too), so
DFlashAttention's windowed draft attention runs on every GPU and the prompts decode past the window.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
from pathlib import Path

from dflash_trt.decoding_modes import DFLASH
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import ENGINE_DTYPES
from dflash_trt.inputs import POSITIVE_INT, IntRange
from dflash_trt.jsonfile import strict_json
from dflash_trt.tiny.heldout import heldout_count

# Qwen3 and Llama 3.x models attend with 128-element heads.
PRODUCTION_HEAD_DIM = 128


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "selftest",
        help="build the tiny pair's engine here and check it against the golden model (GPU + TensorRT-LLM 1.2.x)",
        description=__doc__,
    )
    parser.add_argument("--output_dir", default="selftest_out", help="workspace (checkpoint, engine, report)")
    parser.add_argument(
        "--plugin_library",
        default=None,
        help="libdflash_trt_plugins.so (default: $DFLASH_TRT_PLUGIN_LIB, else plugins/build)",
    )
    parser.add_argument(
        "--num_prompts", type=IntRange(1, heldout_count()), default=8, help="held-out prompts, decoded as one batch"
    )
    parser.add_argument("--max_new_tokens", type=POSITIVE_INT, default=64)
    parser.add_argument("--dtype", default="float16", choices=ENGINE_DTYPES)
    parser.add_argument(
        "--head_dim",
        type=POSITIVE_INT,
        default=PRODUCTION_HEAD_DIM,
        help=f"attention head size of the pair built: {PRODUCTION_HEAD_DIM} (production models' own: the tiny pair "
        "widened), or the tiny pair's own (32) or another multiple of it",
    )
    parser.add_argument(
        "--chunked_context",
        action="store_true",
        help="build with the smallest max_num_tokens, add prompts longer than it and decode with "
        "chunked context on: the evidence needed before enabling it in serving",
    )
    parser.add_argument(
        "--sliding_window",
        type=POSITIVE_INT,
        default=None,
        help="make the drafter's last layer a sliding-window layer of this window (DFlashAttention on every GPU)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace outputs of an earlier self-test")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(func=run)


# The tiny target has 256 positions (max_position_embeddings); an engine runs requests of max_seq_len + K tokens, which
# reach 2K positions further (engine_lengths.longest_max_seq_len), so with its 16-token blocks it builds with 211.
TINY_MAX_INPUT_LEN = 160
LONG_PROMPTS = 2


def selftest_workload(
    texts: list[str], tokenizer, num_prompts: int, block_size: int, chunked_context: bool, max_positions: int
):
    """Engine settings and prompts. With chunked context, max_num_tokens is the least a batch of generation steps
    needs, and the last prompts are longer than that, so their prefill only fits in several context chunks."""
    from dflash_trt.trtllm.build_settings import EngineBuildSettings
    from dflash_trt.trtllm.engine_lengths import longest_max_seq_len

    batch = max(num_prompts, 1)
    prompts = [tokenizer.encode(text) for text in texts[:num_prompts]]
    max_num_tokens = batch * block_size if chunked_context else 1024
    if chunked_context:
        joined = tokenizer.encode("".join(texts))
        if len(joined) <= max_num_tokens:
            raise DFlashTrtError("the held-out prompts are too short to exceed one context chunk")
        long_len = min(max_num_tokens + block_size, TINY_MAX_INPUT_LEN)
        prompts[-LONG_PROMPTS:] = [joined[i * block_size : i * block_size + long_len] for i in range(LONG_PROMPTS)]
    settings = EngineBuildSettings(
        max_batch_size=batch,
        max_input_len=TINY_MAX_INPUT_LEN,
        max_seq_len=longest_max_seq_len(max_positions, block_size - 1),
        max_num_tokens=max_num_tokens,
    )
    return settings, prompts


def engine_generate(
    engine_dir: Path,
    plugin_library: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    end_id: int,
    chunked_context: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """Generated tokens and per-iteration acceptance lengths of every prompt, from the engine's executor.

    Every prompt is in flight at once; each executor response is one decoding iteration, so the tokens it carries
    are that iteration's acceptance length. The first response (the context step's first token) is not counted,
    as in the golden loop.
    """
    from dflash_trt.bench.driver import run_load
    from dflash_trt.executors.contract import Request
    from dflash_trt.executors.trtllm import TrtllmExecutor, inspect_engine

    info = inspect_engine(engine_dir, DFLASH, plugin_library)
    executor = TrtllmExecutor(info, max_batch_size=len(prompts), end_id=end_id, enable_chunked_context=chunked_context)
    requests = [Request(input_ids=p, max_new_tokens=max_new_tokens) for p in prompts]
    trace = asyncio.run(run_load(executor, requests, concurrency=len(requests), timeout_s=600))
    errors = [f"prompt {r.prompt_index}: {r.error}" for r in trace.records if r.error]
    if errors:
        raise DFlashTrtError("the engine failed requests: " + "; ".join(errors))
    records = sorted(trace.records, key=lambda r: r.prompt_index)
    return [r.output_ids for r in records], [r.chunks[1:] for r in records]


def bench_once(engine_dir: Path, plugin_library: str, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """A short concurrency-1 run of the load generator on the same prompts: speed, TTFT/TPOT, acceptance."""
    from dflash_trt.bench.measure import measure_point
    from dflash_trt.bench.workload import Workload
    from dflash_trt.executors.contract import Request
    from dflash_trt.executors.trtllm import TrtllmExecutor, inspect_engine

    info = inspect_engine(engine_dir, DFLASH, plugin_library)
    workload = Workload(
        requests=[Request(input_ids=p, max_new_tokens=max_new_tokens) for p in prompts],
        ignore_eos=False,
        description={"kind": "selftest", "count": len(prompts)},
    )
    point = measure_point(
        lambda _: TrtllmExecutor(info, max_batch_size=1), workload, DFLASH, concurrency=1, timeout_s=600
    )
    return point.without_detail()


def windowed_drafter(out: Path, drafter: Path, window: int) -> Path:
    """A copy of the tiny pair's `drafter` whose last layer attends within `window` positions (same weights)."""
    import json

    from dflash_trt.tiny.models import DRAFT_LAYERS

    copy = out / f"draft-window-{window}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(drafter, copy)
    config = json.loads((copy / "config.json").read_text())
    layers = ["full_attention"] * (DRAFT_LAYERS - 1) + ["sliding_attention"]
    config.update(use_sliding_window=True, sliding_window=window, layer_types=layers)
    (copy / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copy


def compare(golden_model, golden, tokens: list[list[int]], acceptance: list[list[int]], max_new_tokens: int) -> list:
    """The engine's first divergence from the golden loop per prompt (`reference/divergence.py`): tokens in full,
    acceptance lengths of the steps where the golden loop verified a full block (near the budget it verifies a
    shortened one, while the engine drafts a full block and clips). Each is a labelled near-tie or a failure."""
    from dflash_trt.reference.decode import SequenceResult
    from dflash_trt.reference.divergence import compare_decodings

    engine = [SequenceResult(g.input_ids, list(t), list(a)) for g, t, a in zip(golden, tokens, acceptance, strict=True)]
    return compare_decodings(golden_model, golden, engine, max_new_tokens)


def selftest_pair(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """The tiny pair's target and drafter as `--head_dim` and `--sliding_window` ask for them."""
    from dflash_trt.tiny.heldout import draft_dir, target_dir
    from dflash_trt.tiny.models import HEAD_DIM
    from dflash_trt.tiny.widen import widen_pair

    target, draft = target_dir(), draft_dir()
    if args.head_dim % HEAD_DIM:
        raise DFlashTrtError(f"--head_dim must be a multiple of the tiny pair's {HEAD_DIM}, got {args.head_dim}")
    if args.head_dim != HEAD_DIM:
        pair = out / f"pair-hd{args.head_dim}"
        shutil.rmtree(pair, ignore_errors=True)  # a workspace file of an earlier run, rewritten from the asset
        target, draft = widen_pair(target, draft, pair, args.head_dim)
    if args.sliding_window is not None:
        draft = windowed_drafter(out, draft, args.sliding_window)
    return target, draft


def run(args: argparse.Namespace) -> int:
    from dflash_trt.checkpoint.atomic import check_output_apart
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.gpu_targets import resolve_gpu
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.tiny.heldout import asset_dir, load_heldout
    from dflash_trt.tokenizer import load_tokenizer
    from dflash_trt.trtllm.build import require_tensorrt_llm, run_engine_build
    from dflash_trt.trtllm.build_plan import plan_engine_build
    from dflash_trt.trtllm.engine_manifest import check_engine_config

    out = Path(args.output_dir)
    check_output_apart(out, {"the embedded tiny pair": asset_dir(), "--plugin_library": args.plugin_library})
    require_tensorrt_llm(
        " (on a CPU, dflash-trt emulate runs the engine network)"
    )  # before any work: the self-test is meaningless without TensorRT-LLM 1.2.x
    gpu, _ = resolve_gpu(None)  # the engine runs here, so it is built for this GPU and its attention route
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.sliding_window is None else f"-window-{args.sliding_window}"
    checkpoint = out / f"checkpoint-{args.dtype}-hd{args.head_dim}{suffix}"
    target, draft = selftest_pair(args, out)
    convert_checkpoint(target, draft, checkpoint, dtype=args.dtype, overwrite=args.overwrite)
    tokenizer = load_tokenizer(checkpoint)
    golden_model = load_golden_model(checkpoint)
    texts = [p.text for p in load_heldout(limit=max(args.num_prompts, 64))]
    settings, prompts = selftest_workload(
        texts,
        tokenizer,
        args.num_prompts,
        golden_model.draft.spec.verify_width,
        args.chunked_context,
        golden_model.target.spec.max_position_embeddings,
    )
    settings = dataclasses.replace(settings, gpu=gpu)
    plan = plan_engine_build(checkpoint, out / "engine", settings, plugin_library=args.plugin_library)
    engine_dir = run_engine_build(plan, overwrite=args.overwrite)
    check_engine_config(engine_dir)  # the engine's own config.json holds what the plan printed and recorded

    stop_ids = list(golden_model.target.spec.eos_token_ids)
    if not stop_ids:
        raise DFlashTrtError("the tiny pair's checkpoint names no eos token; the self-test needs one end id")
    golden = speculative_generate(golden_model, prompts, args.max_new_tokens, stop_ids[:1])
    tokens, acceptance = engine_generate(
        engine_dir, plan.plugin_library, prompts, args.max_new_tokens, stop_ids[0], chunked_context=args.chunked_context
    )
    divergences = compare(golden_model, golden, tokens, acceptance, args.max_new_tokens)
    problems = [str(d) for d in divergences if not d.near_tie]
    near_ties = [str(d) for d in divergences if d.near_tie]
    report = {
        "engine_dir": str(engine_dir),
        "gpu": gpu,
        "attention": plan.dflash_manifest["attention"],
        "sliding_window": args.sliding_window,
        "prompts": len(prompts),
        "identical": not divergences,
        "problems": problems,
        "near_ties": near_ties,
        "mean_acceptance_length": sum(map(sum, acceptance)) / max(sum(map(len, acceptance)), 1),
        "bench": bench_once(engine_dir, plan.plugin_library, prompts, args.max_new_tokens),
    }
    (out / "selftest.json").write_text(strict_json(report, indent=2) + "\n")
    print(
        strict_json(report)
        if args.json
        else f"{len(prompts)} prompts: engine {'matches' if not problems else 'DIFFERS FROM'} the golden model "
        f"({len(near_ties)} near-ties, mean acceptance {report['mean_acceptance_length']:.2f})"
    )
    if problems:
        raise DFlashTrtError("; ".join(problems))
    return 0
