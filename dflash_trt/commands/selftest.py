"""`dflash-trt selftest`: prove on this GPU host that the DFlash engine decodes exactly like the golden model.

Converts the embedded tiny trained pair, builds its engine with TensorRT-LLM 1.2.x (plugin library required),
runs held-out prompts through `ModelRunnerCpp` in EAGLE mode and through the golden model, and fails unless every
token and every per-step acceptance length agree; then a short `trtllm-bench` run of the same engine reports its
speed and acceptance. Greedy decoding, the engine's only mode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import ENGINE_DTYPES

MANIFEST_KEY = "eagle_choices"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("selftest", help="build the tiny pair's engine here and check it against the "
                                   "golden model (GPU + TensorRT-LLM 1.2.x)", description=__doc__)
    parser.add_argument("--output_dir", default="selftest_out", help="workspace (checkpoint, engine, report)")
    parser.add_argument("--plugin_library", default=None,
                        help="libdflash_trt_plugins.so (default: $DFLASH_TRT_PLUGIN_LIB, else plugins/build)")
    parser.add_argument("--num_prompts", type=int, default=8, help="held-out prompts, decoded as one batch")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float16", choices=ENGINE_DTYPES)
    parser.add_argument("--chunked_context", action="store_true",
                        help="build with the smallest max_num_tokens, add prompts longer than it and decode with "
                             "chunked context on: the evidence needed before enabling it in serving")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs of an earlier self-test")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(func=run)


# The tiny target has 256 positions (max_position_embeddings): prompt + generated tokens stay within them.
TINY_MAX_SEQ_LEN = 256
TINY_MAX_INPUT_LEN = 160
LONG_PROMPTS = 2


def selftest_workload(texts: list[str], tokenizer, num_prompts: int, block_size: int, chunked_context: bool):
    """Engine settings and prompts. With chunked context, max_num_tokens is the least a batch of generation steps
    needs, and the last prompts are longer than that, so their prefill only fits in several context chunks."""
    from dflash_trt.trtllm.build_plan import EngineBuildSettings

    batch = max(num_prompts, 1)
    prompts = [tokenizer.encode(text) for text in texts[:num_prompts]]
    max_num_tokens = batch * block_size if chunked_context else 1024
    if chunked_context:
        joined = tokenizer.encode("".join(texts))
        if len(joined) <= max_num_tokens:
            raise DFlashTrtError("the held-out prompts are too short to exceed one context chunk")
        long_len = min(max_num_tokens + block_size, TINY_MAX_INPUT_LEN)
        prompts[-LONG_PROMPTS:] = [joined[i * block_size:i * block_size + long_len] for i in range(LONG_PROMPTS)]
    settings = EngineBuildSettings(max_batch_size=batch, max_input_len=TINY_MAX_INPUT_LEN,
                                   max_seq_len=TINY_MAX_SEQ_LEN, max_num_tokens=max_num_tokens)
    return settings, prompts


def engine_generate(engine_dir: Path, plugin_library: str, prompts: list[list[int]], max_new_tokens: int,
                    end_id: int, chunked_context: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """Generated tokens and per-step acceptance lengths of every prompt, from the engine via ModelRunnerCpp.

    Acceptance lengths are the growth of each sequence per streamed iteration; the first growth is the context
    step's first token, as in the golden loop, which does not count it either.
    """
    import torch
    from tensorrt_llm.runtime import ModelRunnerCpp

    import dflash_trt.trtllm.model  # noqa: F401  (registers DFlashForCausalLM for EngineConfig parsing)
    from dflash_trt.trtllm.plugin import load_plugin_library

    load_plugin_library(plugin_library)
    manifest = json.loads((engine_dir / "dflash_trt.json").read_text())
    runner = ModelRunnerCpp.from_dir(str(engine_dir), max_batch_size=len(prompts),
                                     eagle_choices=manifest[MANIFEST_KEY], enable_chunked_context=chunked_context)
    lengths = [[len(p)] for p in prompts]
    final: dict[str, Any] | None = None
    for out in runner.generate([torch.tensor(p, dtype=torch.int32) for p in prompts],
                               max_new_tokens=max_new_tokens, end_id=end_id, pad_id=end_id, streaming=True,
                               return_dict=True, output_sequence_lengths=True):
        final = out
        for b, seq_len in enumerate(out["sequence_lengths"][:, 0].tolist()):
            if seq_len > lengths[b][-1]:
                lengths[b].append(seq_len)
    if final is None:
        raise DFlashTrtError("the engine returned no output")
    tokens = [final["output_ids"][b, 0, len(p):lengths[b][-1]].tolist() for b, p in enumerate(prompts)]
    acceptance = [[n - m for m, n in zip(seq[1:-1], seq[2:], strict=True)] for seq in lengths]
    return tokens, acceptance


def bench_once(engine_dir: Path, tokenizer_dir: Path, prompts: list[list[int]], max_new_tokens: int, out: Path,
               runner=None) -> dict:
    """A short `trtllm-bench --backend tensorrt` run of the engine (concurrency 1, the same prompts): its sweep
    record (output tok/s, TPOT, acceptance) or, when trtllm-bench fails, the failure it recorded."""
    from dflash_trt.perf.sweep import EngineEntry, SweepConfig, run_point, subprocess_runner

    dataset = out / "bench_dataset.jsonl"
    dataset.write_text("".join(json.dumps({"task_id": i, "input_ids": p, "output_tokens": max_new_tokens}) + "\n"
                               for i, p in enumerate(prompts)))
    engine = EngineEntry("dflash", "dflash", str(engine_dir))
    config = SweepConfig(model=str(tokenizer_dir), dataset=str(dataset), concurrency=(1,), engines=(engine,),
                         output_dir=str(out / "bench"), num_requests=len(prompts))
    return run_point(config, engine, 1, runner or subprocess_runner)


def compare(golden, tokens: list[list[int]], acceptance: list[list[int]]) -> list[str]:
    """One line per disagreement between the golden results and the engine's tokens / acceptance lengths."""
    problems = []
    for i, result in enumerate(golden):
        if tokens[i] != result.output_ids:
            problems.append(f"prompt {i}: engine tokens differ from the golden model")
        elif acceptance[i] != result.acceptance_lengths:
            problems.append(f"prompt {i}: acceptance lengths {acceptance[i]} != golden {result.acceptance_lengths}")
    return problems


def run(args: argparse.Namespace) -> int:
    from dflash_trt.conversion.convert import convert_checkpoint
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
    from dflash_trt.tokenizer import load_tokenizer
    from dflash_trt.trtllm.build import require_tensorrt_llm, run_engine_build
    from dflash_trt.trtllm.build_plan import plan_engine_build

    require_tensorrt_llm()  # before any work: the self-test is meaningless without TensorRT-LLM 1.2.x
    out = Path(args.output_dir)
    checkpoint = out / f"checkpoint-{args.dtype}"
    convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype=args.dtype, overwrite=args.overwrite)
    tokenizer = load_tokenizer(checkpoint)
    golden_model = load_golden_model(checkpoint)
    texts = [p.text for p in load_heldout(limit=max(args.num_prompts, 64))]
    settings, prompts = selftest_workload(texts, tokenizer, args.num_prompts, golden_model.draft.spec.block_size,
                                          args.chunked_context)
    plan = plan_engine_build(checkpoint, out / "engine", settings, plugin_library=args.plugin_library)
    engine_dir = run_engine_build(plan, overwrite=args.overwrite)

    stop_ids = list(golden_model.target.spec.eos_token_ids)
    if not stop_ids:
        raise DFlashTrtError("the tiny pair's checkpoint names no eos token; the self-test needs one end id")
    golden = speculative_generate(golden_model, prompts, args.max_new_tokens, stop_ids[:1])
    tokens, acceptance = engine_generate(engine_dir, plan.plugin_library, prompts, args.max_new_tokens,
                                         stop_ids[0], chunked_context=args.chunked_context)
    problems = compare(golden, tokens, acceptance)
    report = {"engine_dir": str(engine_dir), "prompts": len(prompts), "identical": not problems,
              "problems": problems,
              "mean_acceptance_length": sum(map(sum, acceptance)) / max(sum(map(len, acceptance)), 1),
              "trtllm_bench": bench_once(engine_dir, checkpoint, prompts, args.max_new_tokens, out)}
    (out / "selftest.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report) if args.json else
          f"{len(prompts)} prompts: engine {'matches' if not problems else 'DIFFERS FROM'} the golden model "
          f"(mean acceptance {report['mean_acceptance_length']:.2f})")
    if problems:
        raise DFlashTrtError("; ".join(problems))
    return 0
