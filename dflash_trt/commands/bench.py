"""`dflash-trt bench`: drive a DFlash engine (TensorRT-LLM executor), a Triton server or the CPU golden model with
closed-loop concurrency or Poisson arrivals; write results.json, report.html and pareto.png.

    dflash-trt bench (--engine_dir E | --checkpoint_dir C | --triton_url HOST:PORT | --openai_url URL)
                     (--input_file P.jsonl | --synthetic ISL,OSL,COUNT) --concurrency 1,2,4
                     [--request_rate R] [--max_new_tokens N] [--baseline ar] --output_dir D

`--baseline ar` adds the target alone at the same points: the checkpoint's target (CPU), `--baseline_engine_dir`
(an AR engine) or `--baseline_triton_url`. Multi-GPU engines run under `mpirun -n <world size>`: rank 0 drives.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dflash_trt.bench.measure import measure_point, request_bar
from dflash_trt.bench.results import RESULTS_FILE, BenchPoint, sweep_fields, write_results
from dflash_trt.bench.targets import Target, check_target, executor_factory, max_positions, provenance, vocab_size
from dflash_trt.bench.workload import (
    REAL_PROMPTS,
    SYNTHETIC_WARNING,
    Workload,
    file_workload,
    parse_synthetic,
    synthetic_workload,
)
from dflash_trt.checkpoint.atomic import atomic_directory, check_destination, check_writable
from dflash_trt.decoding_modes import AR, DFLASH
from dflash_trt.draft_schedule import AUTO, NONE
from dflash_trt.errors import DFlashTrtError
from dflash_trt.executors.contract import FollowerRank
from dflash_trt.inputs import (
    CONCURRENCIES,
    CONCURRENCY,
    DRAFT_LEN_SCHEDULE,
    DRAFT_TREE,
    END_ID,
    GPUS,
    MEMORY_FRACTION,
    POSITIVE_INT,
    REQUEST_RATES,
    REQUESTS,
    SEED,
    TIMEOUT_S,
    URL,
    VOCAB_SIZE,
    WARMUP,
)
from dflash_trt.jsonfile import strict_json
from dflash_trt.prompts import CHAT_TEMPLATE_KWARGS_HELP, parse_chat_template_kwargs
from dflash_trt.tokenizer import load_tokenizer


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load generator: concurrency / request-rate points with per-token "
        "timing and acceptance, on an engine, a Triton server or the CPU golden model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_source_arguments(p)
    p.add_argument(
        "--concurrency", type=CONCURRENCIES, default=None, help="comma-separated closed-loop user counts, e.g. 1,2,4"
    )
    p.add_argument(
        "--request_rate",
        type=REQUEST_RATES,
        default=None,
        help="comma-separated open-loop Poisson arrival rates (req/s)",
    )
    p.add_argument("--max_new_tokens", type=POSITIVE_INT, default=128, help="output budget per prompt (--input_file)")
    p.add_argument("--num_requests", type=REQUESTS, default=None, help="requests per point (default: every prompt)")
    p.add_argument("--warmup", type=WARMUP, default=0, help="requests sent and discarded before each point")
    p.add_argument("--baseline", choices=(AR,), help="also measure the target alone at the same points")
    p.add_argument("--baseline_engine_dir", help="the AR engine for --baseline ar with --engine_dir")
    p.add_argument("--baseline_triton_url", type=URL, help="the AR server for --baseline ar with --triton_url")
    p.add_argument("--tokenizer_dir", help="tokenizer for text prompts (default: the checkpoint's)")
    p.add_argument("--plugin_library", help="libdflash_trt_plugins.so (default: the one dflash_trt.json names)")
    p.add_argument(
        "--max_batch_size",
        type=CONCURRENCY,
        default=None,
        help="executor batch limit (default: the engine's; CPU: the largest concurrency, else 16)",
    )
    p.add_argument(
        "--kv_cache_free_gpu_mem_fraction",
        type=MEMORY_FRACTION,
        default=None,
        help="--engine_dir: share of free GPU memory for the KV cache (default: the executor's own)",
    )
    p.add_argument(
        "--triton_model",
        default="tensorrt_llm",
        help="tensorrt_llm (token ids; the default), or ensemble / tensorrt_llm_bls (text: needs --tokenizer_dir)",
    )
    p.add_argument(
        "--triton_protocol",
        choices=("grpc", "http"),
        default="grpc",
        help="grpc (streaming ModelStreamInfer), or http: ensemble / tensorrt_llm_bls over HTTP generate_stream "
        "(--triton_url then names the HTTP port)",
    )
    p.add_argument(
        "--gpus",
        type=GPUS,
        default=None,
        help="GPUs behind --triton_url / --openai_url, dividing tok/s per GPU (default: for Triton, the GPUs its "
        "tensorrt_llm gpu_device_ids place replicas on, else 1; for an OpenAI server none: tok/s not per GPU)",
    )
    p.add_argument(
        "--end_id",
        type=END_ID,
        default=None,
        help="end token for engine / Triton runs on --input_file (default: the engine config's eos "
        "ids; without one, or with -1, every request runs to --max_new_tokens)",
    )
    p.add_argument(
        "--vocab_size",
        type=VOCAB_SIZE,
        default=None,
        help="the model's token range with --triton_url: synthetic prompts use it, responses are checked against it",
    )
    p.add_argument("--seed", type=SEED, default=0, help="seed of synthetic prompts and Poisson arrivals")
    p.add_argument("--timeout_s", type=TIMEOUT_S, default=3600.0, help="give up on a point after this long")
    p.add_argument("--output_dir", required=True, help="folder for results.json, report.html, pareto.png")
    p.add_argument("--overwrite", action="store_true", help="replace the results of an earlier bench in --output_dir")
    p.add_argument("--json", action="store_true", help="print the points (without per-request data) as JSON")
    p.set_defaults(func=run)


def _add_source_arguments(p: argparse.ArgumentParser) -> None:
    """What is measured (an engine, a checkpoint or a server) and the prompts sent to it."""
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--engine_dir", help="DFlash engine (dflash-trt build): TensorRT-LLM 1.2.x executor, GPU")
    target.add_argument("--checkpoint_dir", help="converted checkpoint: the golden model with in-flight batching, CPU")
    target.add_argument("--triton_url", type=URL, help="Triton gRPC endpoint HOST:PORT of a deployed repository")
    target.add_argument("--openai_url", help="OpenAI endpoint http://HOST:PORT/v1 (dflash-trt serve)")
    p.add_argument(
        "--draft_len_schedule",
        type=DRAFT_LEN_SCHEDULE,
        default=NONE,  # argparse parses a text default through `type`, so help shows it as the user writes it
        help="--checkpoint_dir: the golden model's drafts per request by the step's load, none (default) or "
        "N1:K1,N2:K2,... (an engine's is built into it; `plan --draft_len_schedule auto` prints a GPU's table)",
    )
    p.add_argument(
        "--draft_tree",
        type=DRAFT_TREE,
        default=None,
        metavar="N",
        help="--checkpoint_dir: draft trees of N nodes, run by the emulated engine; results.json's draft_lens are "
        "the nodes each iteration verified (default: the golden model's chain; an engine's tree is built into it)",
    )
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--input_file",
        help='jsonl prompts, {"input_ids": [...]}, {"text": "..."} or {"messages": [...]} per line; real text, '
        f"e.g. {REAL_PROMPTS} (in the repository)",
    )
    p.add_argument("--chat_template_kwargs", default=None, help=CHAT_TEMPLATE_KWARGS_HELP)
    prompts.add_argument(
        "--synthetic",
        metavar="ISL,OSL,COUNT",
        help="random token prompts of ISL tokens, OSL output tokens each (end tokens ignored), COUNT of them; "
        "they understate speculative speedups (drafts are rarely accepted on random ids): prefer --input_file",
    )


def end_of_text(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """The end id a Triton run on --input_file stops at, and where it comes from: --end_id, else the EOS of
    --tokenizer_dir's tokenizer (a deployment does not say its own), else none (requests run to their budget).
    None, None for the other targets: an engine's config and an OpenAI server know their EOS."""
    if args.end_id is not None:
        return args.end_id, "--end_id"
    if not args.triton_url or args.synthetic:
        return None, None
    tokenizer = load_tokenizer(args.tokenizer_dir) if args.tokenizer_dir else None
    eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer is None or eos is None:
        return None, "none: every request runs to --max_new_tokens (give --end_id, or a --tokenizer_dir with an EOS)"
    return eos, f"the EOS {tokenizer.eos_token!r} of the tokenizer in {args.tokenizer_dir}"


def targets(args: argparse.Namespace, end_id: int | None = None) -> dict[str, Target]:
    """The measured target and, with --baseline ar, the target alone, keyed by the name plotted."""
    common = {
        "plugin_library": args.plugin_library,
        "triton_model": args.triton_model,
        "triton_protocol": args.triton_protocol,
        "gpus": args.gpus,
        "end_id": end_id,
        "vocab_size": args.vocab_size,
        "tokenizer_dir": args.tokenizer_dir,
    }
    where = (args.engine_dir, args.checkpoint_dir, args.triton_url, args.openai_url)
    if args.draft_len_schedule == AUTO:
        raise DFlashTrtError(
            "--draft_len_schedule auto is derived for a GPU; the golden model takes a table (dflash-trt plan "
            "--draft_len_schedule auto prints one)"
        )
    out = {
        DFLASH: Target(DFLASH, *where, **common, draft_len_schedule=args.draft_len_schedule, draft_tree=args.draft_tree)
    }
    if args.baseline == AR:
        if args.openai_url:
            raise DFlashTrtError("--baseline ar is not available with --openai_url; bench the AR server separately")
        if args.engine_dir and not args.baseline_engine_dir:
            raise DFlashTrtError("--baseline ar with --engine_dir needs --baseline_engine_dir (an AR engine)")
        if args.triton_url and not args.baseline_triton_url:
            raise DFlashTrtError("--baseline ar with --triton_url needs --baseline_triton_url (an AR deployment)")
        out[AR] = Target(AR, args.baseline_engine_dir, args.checkpoint_dir, args.baseline_triton_url, **common)
    for target in out.values():
        check_target(target)
    return out


def build_workload(args: argparse.Namespace, target: Target) -> Workload:
    if args.synthetic:
        synthetic = parse_synthetic(args.synthetic)
        vocab = vocab_size(target)
        if not vocab:
            raise DFlashTrtError("--synthetic with a server URL needs --vocab_size (the model's token range)")
        workload = synthetic_workload(synthetic, vocab, args.seed, max_positions(target))
    else:
        if not Path(args.input_file).exists():  # before the (slow) tokenizer load
            raise DFlashTrtError(f"prompt file {args.input_file} does not exist")
        tokenizer_dir = args.tokenizer_dir or args.checkpoint_dir
        tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        chat_kwargs = parse_chat_template_kwargs(args.chat_template_kwargs)
        workload = file_workload(
            args.input_file,
            args.max_new_tokens,
            tokenizer,
            chat_kwargs=chat_kwargs,
            max_positions=max_positions(target),
        )
    if args.num_requests is not None:
        workload = workload.resized(args.num_requests)
    if args.synthetic and target.mode != AR:  # after every refusal, which stays the only line on stderr
        print(SYNTHETIC_WARNING, file=sys.stderr)
    return workload


def analysis_records(points: list[BenchPoint]) -> list[dict[str, Any]]:
    """Closed-loop points in the shape the Pareto report reads."""
    return [
        {"engine": p.engine, "kind": p.mode, "concurrency": p.concurrency, "status": "ok", **sweep_fields(p)}
        for p in points
        if p.concurrency is not None and p.requests and sweep_fields(p)["tok_s_user_tpot"] is not None
    ]


def points_table(points: list[BenchPoint]):
    def cell(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)

    rows = [
        [
            p.engine,
            cell(p.concurrency, "{}"),
            cell(p.request_rate, "{:g}"),
            str(p.requests),
            str(p.failed),
            cell(p.throughput_tok_s),
            cell(sweep_fields(p)["tok_s_user_tpot"]),
            cell(p.ttft_s and p.ttft_s.p50 * 1000),
            cell(p.tpot_s and p.tpot_s.p50 * 1000, "{:.2f}"),
            cell(p.acceptance_length, "{:.2f}"),
            str(p.max_in_flight),
        ]
        for p in points
    ]
    header = [
        "engine",
        "concurrency",
        "rate (req/s)",
        "requests",
        "failed",
        "output tok/s",
        "tok/s/user (1 / mean TPOT)",
        "TTFT p50 (ms)",
        "TPOT p50 (ms)",
        "acceptance",
        "max in flight",
    ]
    return "Measured points", header, rows


def check_output(out: Path, overwrite: bool) -> None:
    """Before any measuring: the folder can be written, and replacing it deletes only an earlier bench output."""
    check_destination(Path(os.path.abspath(out)), overwrite, "bench")
    check_writable(out)


def provenance_table(provenance: dict[str, Any]):
    host = provenance["host"]
    rows = [
        ["backend", provenance["backend"]],
        ["target", provenance["target"]],
        ["CPU", host["cpu"]],
        ["GPUs", ", ".join(host["gpus"]) or "none"],
        ["versions", ", ".join(f"{k} {v}" for k, v in sorted(provenance["versions"].items()))],
        ["git revision", provenance["git_revision"] or "-"],
        ["started", provenance["started"]],
    ]
    return "Where these numbers come from", ["", ""], rows


def subtitle(workload: dict[str, Any], provenance: dict[str, Any]) -> str:
    """What a pasted plot must carry to be read alone: the model measured, the prompts and the date."""
    requests = workload.get("num_requests", workload.get("count"))
    if workload.get("kind") == "file":
        name, new = Path(workload["path"]).name, workload["max_new_tokens"]
        prompts = f"{requests} requests from {name} ({workload['count']} prompts), up to {new} new tokens"
    elif workload.get("kind") == "synthetic":
        prompts = f"{requests} synthetic requests, ISL {workload['input_len']} / OSL {workload['output_len']}"
    else:
        prompts = f"a {workload.get('kind')} workload"
    return f"{provenance['target']} | {prompts} | {provenance['started'][:10]}"


def write_outputs(
    out: Path, points: list[BenchPoint], workload: dict[str, Any], provenance: dict[str, Any], overwrite: bool
) -> dict:
    """results.json, report.html and pareto.png, published at once (an existing folder is replaced only when an
    earlier `bench` wrote it)."""
    from dflash_trt.analysis.report import analyze_records

    with atomic_directory(out, "bench", overwrite) as staging:
        write_results(staging / RESULTS_FILE, [p.to_json() for p in points], workload, provenance)
        records = analysis_records(points)
        title = f"dflash-trt bench, {provenance['backend']} backend: throughput vs interactivity\n" + subtitle(
            workload, provenance
        )
        tables = [provenance_table(provenance), points_table(points)]
        summary = analyze_records(records, "tpot", None, staging, tables, title) if records else {}
    return summary


def run(args: argparse.Namespace) -> int:
    concurrencies, rates = args.concurrency or [], args.request_rate or []
    if not concurrencies and not rates:
        raise DFlashTrtError("give --concurrency and/or --request_rate")
    if args.synthetic and args.chat_template_kwargs is not None:
        raise DFlashTrtError("--chat_template_kwargs applies to --input_file prompts, not --synthetic token ids")
    parse_chat_template_kwargs(args.chat_template_kwargs)  # refused before any model loads
    out = Path(args.output_dir)
    check_output(out, args.overwrite)
    end_id, end_from = end_of_text(args)
    if end_from is not None:
        print(f"end id {end_id}: {end_from}" if end_id is not None else f"end id {end_from}", file=sys.stderr)
    chosen = targets(args, end_id)
    workload = build_workload(args, chosen[DFLASH])
    origin = provenance(chosen[DFLASH])

    def progress(point: BenchPoint) -> None:
        print(
            f"{point_name(point)}: {point.throughput_tok_s:.1f} tok/s, acceptance "
            f"{point.acceptance_length or 0:.2f}, {point.failed} failed",
            file=sys.stderr,
        )

    points, follower = [], False
    for name, target in chosen.items():
        factory = executor_factory(target, workload, args.max_batch_size, args.kv_cache_free_gpu_mem_fraction)
        for concurrency, rate in [(c, None) for c in concurrencies] + [(None, r) for r in rates]:
            where = f"c={concurrency}" if concurrency else f"rate={rate:g}/s"
            bar = request_bar(len(workload.requests), f"{name} {where}", enabled=not args.json)
            try:
                point = measure_point(
                    factory,
                    workload,
                    name,
                    concurrency=concurrency,
                    request_rate=rate,
                    warmup=args.warmup,
                    seed=args.seed,
                    timeout_s=args.timeout_s,
                    max_in_flight=args.max_batch_size,
                    on_request_done=bar.update,
                )
            except FollowerRank:
                follower = True
                continue
            finally:
                bar.close()
            points.append(point)
            if not args.json:
                progress(point)
    if follower:
        return 0  # rank 0 writes the results
    stops = {} if end_from is None else {"end_id": end_id, "end_id_from": end_from}
    write_outputs(out, points, workload.description | stops, origin, args.overwrite)
    if args.json:
        print(
            strict_json([p.without_detail() for p in points]),
        )
    else:
        print(f"results: {out / RESULTS_FILE}; report: {out / 'report.html'}")
    for point in points:
        if point.failed:
            failed = f"{point.failed} requests failed; first: {first_error(point)}"
            print(f"{point_name(point)}: {failed}", file=sys.stderr)
    dead = [point for point in points if point.failed and not point.requests]
    if dead:
        raise DFlashTrtError(f"every request of {point_name(dead[0])} failed: {first_error(dead[0])}")
    return 0


def point_name(point: BenchPoint) -> str:
    where = f"c={point.concurrency}" if point.concurrency else f"rate={point.request_rate:g}/s"
    return f"{point.engine} {where}"


def first_error(point: BenchPoint) -> str:
    return next((r.error for r in point.per_request if r.error), "no output tokens")
