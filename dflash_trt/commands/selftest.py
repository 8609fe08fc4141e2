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

from dflash_trt.errors import DFlashTrtError

MANIFEST_KEY = "eagle_choices"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("selftest", help="build the tiny pair's engine here and check it against the "
                                   "golden model (GPU + TensorRT-LLM 1.2.x)", description=__doc__)
    parser.add_argument("--output_dir", default="selftest_out", help="workspace (checkpoint, engine, report)")
    parser.add_argument("--plugin_library", default=None,
                        help="libdflash_trt_plugins.so (default: $DFLASH_TRT_PLUGIN_LIB, else plugins/build)")
    parser.add_argument("--num_prompts", type=int, default=8, help="held-out prompts, decoded as one batch")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--overwrite", action="store_true", help="replace outputs of an earlier self-test")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(func=run)


def engine_generate(engine_dir: Path, plugin_library: str, prompts: list[list[int]], max_new_tokens: int,
                    end_id: int) -> tuple[list[list[int]], list[list[int]]]:
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
                                     eagle_choices=manifest[MANIFEST_KEY])
    lengths = [[len(p)] for p in prompts]
    final = None
    for out in runner.generate([torch.tensor(p, dtype=torch.int32) for p in prompts],
                               max_new_tokens=max_new_tokens, end_id=end_id, pad_id=end_id, streaming=True,
                               return_dict=True, output_sequence_lengths=True):
        final = out
        for b, seq_len in enumerate(out["sequence_lengths"][:, 0].tolist()):
            if seq_len > lengths[b][-1]:
                lengths[b].append(seq_len)
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
    from dflash_trt.checkpoint.atomic import check_output_apart
    from dflash_trt.checkpoint.convert import convert_checkpoint
    from dflash_trt.reference.decode import speculative_generate
    from dflash_trt.reference.model import load_golden_model
    from dflash_trt.tiny.heldout import asset_dir, draft_dir, load_heldout, target_dir
    from dflash_trt.tokenizer import load_tokenizer
    from dflash_trt.trtllm.build import require_tensorrt_llm, run_engine_build
    from dflash_trt.trtllm.build_plan import EngineBuildSettings, plan_engine_build

    out = Path(args.output_dir)
    check_output_apart(out, {"the embedded tiny pair": asset_dir(), "--plugin_library": args.plugin_library})
    require_tensorrt_llm()  # before any work: the self-test is meaningless without TensorRT-LLM 1.2.x
    checkpoint = out / f"checkpoint-{args.dtype}"
    convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype=args.dtype, overwrite=args.overwrite)
    settings = EngineBuildSettings(max_batch_size=max(args.num_prompts, 1), max_input_len=256, max_seq_len=512,
                                   max_num_tokens=1024)
    plan = plan_engine_build(checkpoint, out / "engine", settings, plugin_library=args.plugin_library)
    engine_dir = run_engine_build(plan, overwrite=args.overwrite)

    tokenizer = load_tokenizer(checkpoint)
    prompts = [tokenizer.encode(p.text) for p in load_heldout(limit=args.num_prompts)]
    golden_model = load_golden_model(checkpoint)
    stop_ids = list(golden_model.target.spec.eos_token_ids)
    if not stop_ids:
        raise DFlashTrtError("the tiny pair's checkpoint names no eos token; the self-test needs one end id")
    golden = speculative_generate(golden_model, prompts, args.max_new_tokens, stop_ids[:1])
    tokens, acceptance = engine_generate(engine_dir, plan.plugin_library, prompts, args.max_new_tokens,
                                         stop_ids[0])
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
