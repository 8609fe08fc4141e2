"""`dflash-trt plan`: predicted throughput curves, capacity of a build profile, and the model's own evidence.

Modes: curves for a target + drafter (`--preset` or `--model_dir`); `--config P` for the memory budget and the
sequences a profile's engine holds; `--validate` for the model against every published point (fit/eval split);
`--provenance` for where each constant comes from; `--calibrate results.json` to fit the overheads to one's own
`dflash-trt bench` results.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from dflash_trt.analysis.acceptance_file import read_acceptance_file
from dflash_trt.analysis.draft_schedule import ScheduleRow, compare_schedule, derive_schedule
from dflash_trt.analysis.gpus import GPUS, get_gpu
from dflash_trt.analysis.harness_fits import HARNESSES, calibration
from dflash_trt.analysis.memory import EngineLimits, FeasiblePoint, feasible_curve
from dflash_trt.analysis.model import (
    PRECISION,
    Acceptance,
    Calibration,
    Deployment,
    DFlashShape,
    Method,
    TargetShape,
    mean_context,
)
from dflash_trt.analysis.pareto import Point, crossover_concurrency, speedup_table
from dflash_trt.analysis.published import PAIRS, TAU_SOURCES, TAUS, WORKLOADS, pair_for_models, workload_taus
from dflash_trt.analysis.shapes import eagle3_like, load_models
from dflash_trt.analysis.tree_acceptance import RESIDUAL_RATIO, tree_method
from dflash_trt.checkpoint.sharding import tp_refusal
from dflash_trt.decoding_modes import AR, DFLASH, EAGLE3
from dflash_trt.draft_schedule import AUTO, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import KV_CACHE_DTYPES, NONE, QFORMATS
from dflash_trt.inputs import (
    CONCURRENCIES,
    DRAFT_LEN_SCHEDULE,
    DRAFT_TREE,
    POSITIVE_INT,
    SPEED,
    SPEED_LEVELS,
    TEMPERATURE,
    FloatRange,
    IntRange,
    draft_tree_nodes,
)
from dflash_trt.inputs import GPUS as GPU_COUNT
from dflash_trt.jsonfile import strict_json
from dflash_trt.pipeline.profiles import load_profile
from dflash_trt.trtllm.build_limits import MAX_EAGLE_DRAFT_LEN

DEFAULT_LENGTHS = (1024, 1024)
# Draft tokens per step and tokens accepted per step (the bonus included) an EAGLE-mode engine can be built for.
DRAFT_LEN = IntRange(1, MAX_EAGLE_DRAFT_LEN)
ACCEPTANCE_LENGTH = FloatRange(1.0, MAX_EAGLE_DRAFT_LEN + 1)
BAND_CAVEAT = (
    "note: ratios at levels only AR's smallest batches reach compare against AR's last frontier point and grow "
    "without bound near its ceiling; the held-out evaluation (plan --validate) shows where the model misses."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="predict tok/s/user and tok/s/GPU vs concurrency; profile capacity; model evidence",
        description="Roofline prediction of AR, EAGLE-3-like and DFlash decoding on H100/H200/B200/B300 from model "
        "shapes and an acceptance-length distribution; --config prints a build profile's memory budget and "
        "capacity; --validate, --provenance and --calibrate show how far the model can be trusted.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model_dir", help="target HF checkpoint folder (only config.json is read)")
    src.add_argument("--preset", choices=sorted(PAIRS), help="a published target + DFlash drafter pair")
    p.add_argument("--dflash_model_dir", help="DFlash drafter folder (z-lab or speculators format); with --model_dir")
    p.add_argument("--gpu", choices=sorted(GPUS), default="b200")
    p.add_argument("--tp_size", type=GPU_COUNT, default=1)
    p.add_argument("--qformat", choices=QFORMATS, default=NONE, help="weight format (none = 16-bit weights)")
    p.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=NONE)
    _add_acceptance_args(p)
    p.add_argument("--eagle3_acceptance_length", type=ACCEPTANCE_LENGTH, help="also predict an EAGLE-3-like drafter")
    p.add_argument("--eagle3_steps", type=DRAFT_LEN, default=3)
    p.add_argument("--concurrency", type=CONCURRENCIES, default="1,2,4,8,16,32,64,128,256", help="comma-separated list")
    for flag, what in (("--isl", "input"), ("--osl", "output")):
        p.add_argument(
            flag, type=POSITIVE_INT, help=f"mean {what} length in tokens (default 1024; --config: the sweep's)"
        )
    p.add_argument(
        "--calibration",
        default="trtllm",
        help=f"fitted overheads: one of {', '.join(HARNESSES)} (one committed calibration each, with its error band) "
        "or a file written by --calibrate --output (refused on other hardware)",
    )
    p.add_argument("--levels", type=SPEED_LEVELS, help="comma-separated tok/s/user values for the speedup-vs-AR table")
    p.add_argument(
        "--max_batch_size",
        type=POSITIVE_INT,
        help="engine limit the curves respect (default: the largest --concurrency, at most trtllm-build's 2048)",
    )
    p.add_argument(
        "--max_num_tokens",
        type=POSITIVE_INT,
        default=EngineLimits.max_num_tokens,
        help="engine limit the curves respect (default: %(default)s, trtllm-build's)",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--config", help="build profile YAML: print its memory budget and the sequences that fit")
    what.add_argument(
        "--calibrate", metavar="RESULTS_JSON", help="fit the overheads to a `dflash-trt bench` results.json"
    )
    what.add_argument(
        "--node",
        metavar="NxGPU",
        help="users one node (e.g. 8xb300) serves at --min_tok_s_user: best TP x replicas x batch per method",
    )
    what.add_argument("--validate", action="store_true", help="print the model vs every published point and exit")
    what.add_argument("--provenance", action="store_true", help="print every constant's value, kind and source")
    p.add_argument("--min_tok_s_user", type=SPEED, default=500.0, help="with --node: the speed every user must get")
    p.add_argument("--output", help="with --calibrate: write the stamped calibration to this JSON file")
    p.add_argument("--overwrite", action="store_true", help="with --output: replace an existing file")
    p.add_argument("--json", action="store_true", help="print machine-readable output")
    p.set_defaults(func=run)


def _add_acceptance_args(p: argparse.ArgumentParser) -> None:
    """Where the DFlash acceptance comes from and at which draft length it was measured and is planned."""
    p.add_argument(
        "--acceptance_length",
        type=ACCEPTANCE_LENGTH,
        help="mean tokens per verify step incl. the bonus token, as measured with --acceptance_draft_len drafts per "
        "step (default with --preset: the published value, measured with the drafter's full block)",
    )
    p.add_argument(
        "--acceptance_draft_len",
        type=DRAFT_LEN,
        help="the draft length --acceptance_length was measured at (default: the drafter's block - 1); with "
        "--max_draft_len the mean is re-derived for that length: a shorter draft cuts every longer accepted run, a "
        "longer one continues at the measured per-position rate",
    )
    p.add_argument(
        "--acceptance_json",
        help='JSON with "histogram" (steps yielding 1..B tokens) or "per_position" (conditional acceptance rates)',
    )
    p.add_argument(
        "--workload",
        default="gsm8k",
        help=f"with --preset: the dataset (or {', '.join(WORKLOADS)}) whose published acceptance lengths to use",
    )
    p.add_argument(
        "--temperature", type=TEMPERATURE, help="with --preset: the sampling temperature of those lengths (0 or 1)"
    )
    p.add_argument(
        "--max_draft_len",
        type=DRAFT_LEN,
        help="drafts per step to plan for (default: what the acceptance was measured at; at most block - 1)",
    )
    p.add_argument(
        "--draft_len_schedule",
        type=DRAFT_LEN_SCHEDULE,
        help="plan our engine under a draft-length schedule: auto (derived here: at each batch the draft length "
        "serving the most tok/s; printed as the table build takes), none, or N1:K1,N2:K2,... (with at least N "
        "requests in a step, draft K); prints AR, the full draft length and the schedule side by side",
    )
    p.add_argument(
        "--draft_tree",
        type=DRAFT_TREE,
        default=None,
        metavar="N",
        help="plan our engine verifying draft trees of N nodes (N + 1 target tokens a step; acceptance: the best "
        "static tree over the chain's per-position rates, docs/performance.md; default: the chain)",
    )


def _emit(text: str) -> None:
    """Write to stdout; a reader that closes early (`| head`) is one clear error, not a traceback."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise DFlashTrtError("standard output was closed before the output was written (broken pipe)") from None


def _lengths(args: argparse.Namespace, default: tuple[int, int]) -> tuple[int, int]:
    return (default[0] if args.isl is None else args.isl), (default[1] if args.osl is None else args.osl)


def _published_taus(args: argparse.Namespace) -> tuple[list[float], str]:
    """The published acceptance lengths of --workload at --temperature for --preset, and a note naming them."""
    if not args.preset or args.preset not in TAUS:
        raise DFlashTrtError(
            "no acceptance length is published for this pair: give --acceptance_length or "
            "--acceptance_json (e.g. measured by `dflash-trt bench`)"
        )
    found = workload_taus(args.preset, args.workload, args.temperature)
    temp = "not stated" if args.temperature is None and args.preset == "gpt-oss-120b" else args.temperature or 0
    per = ", ".join(f"{d} {t}" for d, t in found.items())
    spread = f"; range {min(found.values())}-{max(found.values())}" if len(found) > 1 else ""
    source = TAU_SOURCES[args.preset]
    note = f"acceptance length per dataset, workload {args.workload} at T={temp}: {per}{spread} ({source})"
    return sorted({min(found.values()), max(found.values())}), note


def _measured_acceptance(args: argparse.Namespace, block: int) -> tuple[list[Acceptance], str]:
    """The acceptance distributions as measured (one per end of a published range), and where they came from."""
    if args.acceptance_length is not None and args.acceptance_json is not None:
        raise DFlashTrtError("give at most one of --acceptance_length and --acceptance_json")
    if args.acceptance_draft_len is not None and args.acceptance_length is None:
        raise DFlashTrtError("--acceptance_draft_len says where --acceptance_length was measured: give both")
    if args.acceptance_json:
        path = Path(args.acceptance_json)
        acc = read_acceptance_file(path, block)
        return [acc], f"acceptance from {path}, measured with {acc.max_length - 1} drafts per step"
    if args.acceptance_length is not None:
        drafts = block - 1 if args.acceptance_draft_len is None else args.acceptance_draft_len
        if drafts >= block:
            raise DFlashTrtError(f"--acceptance_draft_len must lie in [1, {block - 1}] (the drafter's block - 1)")
        acc = Acceptance.from_mean(args.acceptance_length, drafts + 1)
        return [acc], f"acceptance length {args.acceptance_length:g} given, measured with {drafts} drafts per step"
    taus, note = _published_taus(args)
    return [Acceptance.from_mean(t, block) for t in taus], note


def load_acceptance(args: argparse.Namespace, block: int) -> tuple[list[Acceptance], str]:
    """The DFlash acceptance distributions at the planned draft length (one per end of a published range) and a
    note saying where they came from and at which draft length they were measured."""
    accs, note = _measured_acceptance(args, block)
    if args.max_draft_len is None:
        return accs, note
    if args.max_draft_len >= block:
        raise DFlashTrtError(f"--max_draft_len must lie in [1, {block - 1}]")
    resized = [a.resized(args.max_draft_len + 1) for a in accs]
    means = ", ".join(f"{a.mean():.2f}" for a in resized)
    return resized, f"{note}; at --max_draft_len {args.max_draft_len}: mean {means}"


def _check_tp(target: TargetShape, drafter: DFlashShape | None, tp: int) -> None:
    for what, model in (("target", target), ("drafter", drafter)):
        stack = None if model is None else model.stack
        refusal = None if stack is None else tp_refusal(stack.num_heads, stack.num_kv_heads, stack.intermediate, tp)
        if refusal is not None:
            raise DFlashTrtError(f"{what}: {refusal}")


def _eagle3_method(args: argparse.Namespace, target: TargetShape) -> Method:
    """An EAGLE-3-like drafter of --eagle3_steps drafts at --eagle3_acceptance_length."""
    acc = Acceptance.from_mean(args.eagle3_acceptance_length, args.eagle3_steps + 1)
    return Method(EAGLE3, eagle3_like(target, args.eagle3_steps), acc)


def _models(args: argparse.Namespace) -> tuple[TargetShape, DFlashShape | None]:
    if args.preset:
        return PAIRS[args.preset].load()
    if args.model_dir:
        return load_models(args.model_dir, args.dflash_model_dir)
    raise DFlashTrtError("give --model_dir (with --dflash_model_dir), --preset or --config")


def _validate(args: argparse.Namespace) -> None:
    from dflash_trt.analysis import band_shape, evaluation, validation_report

    rows = evaluation.evaluate()
    if not args.json:
        shape = band_shape.markdown_band_shape(band_shape.band_shape())
        tables = validation_report.markdown_tables(rows)
        _emit(f"{tables}\n\nShape of the >15x claim (gpt-oss-120b, 8x B300, MXFP4):\n{shape}")
        return
    predictors = ("model", "k_tau", "persistence")
    summaries = validation_report.summarize(rows)
    out = {
        "points": [r.as_json() for r in rows],
        "summaries": [
            {
                "group": s.group,
                **{
                    name: {"points": n, "median_abs_error": med, "worst_error": worst}
                    for name, (n, med, worst) in zip(predictors, (s.model, s.k_tau, s.persistence), strict=True)
                },
                "within_band": {"points": s.within_band[0], "of": s.within_band[1]},
            }
            for s in summaries
        ],
        "goals": [
            {"goal": g, "achieved": v, "target": t, "met": m} for g, v, t, m in validation_report.goals(summaries)
        ],
        "leave_one_source_out": [vars(r) for r in evaluation.leave_one_source_out()],
    }
    _emit(strict_json(out, indent=2))


def _provenance(args: argparse.Namespace) -> None:
    from dflash_trt.pipeline import provenance

    table = provenance.as_json()
    if args.json:
        _emit(strict_json(table, indent=2))
        return
    _emit("\n".join(f"{name}\t{c['value']}\t{c['kind']}\t{c['source']}" for name, c in table.items()))


def _profile_models_on_disk(profile) -> tuple[TargetShape, DFlashShape]:
    """Shapes of a profile's models that are local folders (or already in the HF cache): their config.json."""
    from dflash_trt.pipeline.profiles import resolve_model_dir

    try:
        target_dir = resolve_model_dir(profile.model.target)
        draft_dir = resolve_model_dir(profile.model.draft)
    except DFlashTrtError:
        raise DFlashTrtError(
            f"the shapes of {profile.model.target} + {profile.model.draft} are not recorded and not on this machine "
            "(no local folder, not in the HF cache): pass --model_dir and --dflash_model_dir (only their "
            "config.json is read)"
        ) from None
    target, drafter = load_models(str(target_dir), str(draft_dir))
    assert drafter is not None  # load_models reads a drafter whenever its folder is given
    return target, drafter


def _capacity(args: argparse.Namespace) -> None:
    from dflash_trt.pipeline.capacity import capacity_warnings, describe, plan_capacity
    from dflash_trt.pipeline.schedule import engine_deployment, profile_acceptance, profile_schedule

    profile = load_profile(args.config)
    if args.model_dir:
        if not args.dflash_model_dir:
            raise DFlashTrtError("--config with --model_dir also needs --dflash_model_dir")
        target, maybe_drafter = load_models(args.model_dir, args.dflash_model_dir)
        assert maybe_drafter is not None  # load_models reads a drafter whenever its folder is given
        drafter = maybe_drafter
    elif (key := pair_for_models(profile.model.target, profile.model.draft)) is not None:
        target, drafter = PAIRS[key].load()
    else:
        target, drafter = _profile_models_on_disk(profile)
    _check_tp(target, drafter, profile.checkpoint.tp_size)
    shape = _lengths(args, (profile.sweep.input_len, profile.sweep.output_len))
    cap = plan_capacity(profile, target, drafter, shape)
    warnings = capacity_warnings(profile, cap)
    resolved = profile_schedule(profile, target, drafter)
    batches = sorted({c for c in profile.sweep.concurrency if c <= profile.engine.max_batch_size})
    rows = compare_schedule(
        target, drafter, profile_acceptance(profile, drafter), resolved.schedule, engine_deployment(profile),
        mean_context(profile.sweep.input_len, profile.sweep.output_len), batches, profile.engine.draft_tree or 0,
    )  # fmt: skip
    if args.json:
        schedule = {
            "schedule": resolved.schedule.text(),
            "source": resolved.source,
            "rows": [r.as_json() for r in rows],
        }
        out = {"profile": profile.name, "capacity": cap.as_json(), "draft_len_schedule": schedule, "warnings": warnings}
        _emit(strict_json(out, indent=2))
    else:
        _emit(describe(profile, cap))
        _emit(f"draft-length schedule {resolved.schedule.text()} ({resolved.source})")
        _emit("\n".join(schedule_lines(resolved.schedule, [("", rows)])[1:]))
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)


def _deployment(args: argparse.Namespace, target: TargetShape, drafter: DFlashShape | None, cal: Calibration):
    _check_tp(target, drafter, args.tp_size)
    return Deployment(get_gpu(args.gpu), PRECISION[args.qformat], PRECISION[args.kv_cache_dtype], args.tp_size, cal)


def _calibrate(args: argparse.Namespace) -> None:
    from dflash_trt.analysis.calibrate import fit, hardware_of, read_bench_results, write_calibration

    target, drafter = _models(args)
    results = read_bench_results(args.calibrate)
    given = (args.isl, args.osl) != (None, None)
    lengths = _lengths(args, results.lengths or DEFAULT_LENGTHS)
    if results.lengths is not None and given and lengths != results.lengths:
        raise DFlashTrtError(
            f"{args.calibrate} ran at {results.lengths[0]}/{results.lengths[1]} tokens but --isl/--osl say "
            f"{lengths[0]}/{lengths[1]}: drop them to use the recorded lengths"
        )
    prov = results.provenance
    hardware = hardware_of(prov) if prov is not None else None
    if hardware in GPUS and hardware != args.gpu:
        raise DFlashTrtError(f"{args.calibrate} ran on {hardware}, not on --gpu {args.gpu}: pass --gpu {hardware}")
    if args.output and prov is None:
        raise DFlashTrtError(
            f"{args.calibrate} has no 'provenance' object saying where it ran, so a calibration from it cannot be "
            "stamped: rerun `dflash-trt bench`, which records it"
        )
    dep = _deployment(args, target, drafter, Calibration("measured"))
    cal, residuals = fit(results.points, target, drafter, dep, mean_context(*lengths), args.calibrate)
    stamp = None
    if prov is not None:
        stamp = {
            "hardware": hardware,
            "gpus": prov["host"]["gpus"],
            "cpu": prov["host"]["cpu"],
            "backend": prov["backend"],
            "target": prov["target"],
            "gpu": args.gpu,
            "tp_size": args.tp_size,
            "precision": dep.precision,
            "kv_dtype": dep.kv_dtype,
            "isl": lengths[0],
            "osl": lengths[1],
            "results": str(args.calibrate),
            "git_revision": prov.get("git_revision"),
            "started": prov.get("started"),
        }
    if args.output:
        assert stamp is not None  # refused above when the results carry no provenance
        write_calibration(args.output, cal, stamp, args.overwrite)
    if args.json:
        _emit(
            strict_json(
                {
                    "calibration": vars(cal),
                    "stamp": stamp,
                    "residuals": [
                        vars(r.point) | {"predicted_tok_s_user": r.predicted_tok_s_user, "error": r.error}
                        for r in residuals
                    ],
                },
                indent=2,
            )
        )
        return
    head = (
        f"calibration: step_overhead_s {cal.step_overhead_s:.6f}, spec_overhead_s {cal.spec_overhead_s:.6f}, "
        f"sequence_overhead_s {cal.sequence_overhead_s:.3e}, token_overhead_s {cal.token_overhead_s:.3e}, "
        f"collective_slowdown {cal.collective_slowdown:.2f}; error band ±{100 * cal.error_band:.1f}%"
    )
    where = (
        "not stamped: the results carry no provenance"
        if stamp is None
        else f"measured on {stamp['hardware']} with the {stamp['backend']} backend at {lengths[0]}/{lengths[1]} tokens"
    )
    columns = f"{'mode':<8} {'conc':>6} {'tau':>6} {'measured':>10} {'model':>10} {'error':>8}"
    lines = [f"{head} ({cal.source})", where, columns]
    for r in residuals:
        p = r.point
        lines.append(
            f"{p.mode:<8} {p.concurrency:>6} {p.acceptance_length:>6.2f} {p.tok_s_user:>10.1f} "
            f"{r.predicted_tok_s_user:>10.1f} {100 * r.error:>+7.1f}%"
        )
    if args.output:
        lines.append(f"wrote {args.output}")
    _emit("\n".join(lines))


def _calibration(args: argparse.Namespace) -> tuple[Calibration, list[str]]:
    """The built-in harness's committed calibration, or a calibration file's fit (refused on other hardware)."""
    if args.calibration in HARNESSES:
        return calibration(args.calibration), []
    from dflash_trt.analysis.calibrate import load_calibration

    path = Path(args.calibration)
    if not path.is_file():
        raise DFlashTrtError(
            f"--calibration must be one of {', '.join(HARNESSES)} or a calibration file; {path} does not exist"
        )
    cal, stamp = load_calibration(path)
    if stamp["hardware"] != args.gpu:
        raise DFlashTrtError(
            f"{path} was fitted on {stamp['hardware']} ({stamp['backend']} backend); it does not apply to --gpu "
            f"{args.gpu}: calibrate on the hardware you plan for"
        )
    notes = [
        f"note: {path} was fitted at {key} {stamp[key]}, this plan uses {mine}"
        for key, mine in (
            ("tp_size", args.tp_size),
            ("precision", PRECISION[args.qformat]),
            ("kv_dtype", PRECISION[args.kv_cache_dtype]),
        )
        if stamp[key] != mine
    ]
    head = f"calibration file {path}: {stamp['backend']} backend, {stamp['isl']}/{stamp['osl']} tokens"
    return cal, [head, *notes]


def _limits(args: argparse.Namespace, concurrencies: list[int]) -> EngineLimits:
    default = min(max(concurrencies), EngineLimits.max_batch_size)
    batch = default if args.max_batch_size is None else args.max_batch_size
    return EngineLimits(batch, args.max_num_tokens)


def _ran(curve: list[FeasiblePoint]) -> list[Point]:
    """The distinct batches that run (a capped request repeats the largest one)."""
    seen, out = set(), []
    for fp in curve:
        if fp.point is not None and fp.batch not in seen:
            seen.add(fp.batch)
            out.append(Point(fp.point.engine, fp.batch, fp.point.tok_s_user, fp.point.tok_s_gpu))
    return out


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if math.isclose(lo, hi, rel_tol=5e-4) else f"{lo:.1f}-{hi:.1f}"


def band_text(cal: Calibration) -> str:
    """How far a prediction made with `cal` can be off, in one line."""
    return f"error band ±{100 * cal.error_band:.0f}% on every predicted number ({cal.band_source})"


def _draft_tree(args: argparse.Namespace, drafter: DFlashShape | None) -> int | None:
    """The planned tree's nodes (None: the chain), by the node rule the engine and the golden loop share."""
    if args.draft_tree is None:
        return None
    if drafter is None:
        raise DFlashTrtError("--draft_tree plans a drafter: pass --dflash_model_dir or --preset")
    if args.draft_tree > MAX_EAGLE_DRAFT_LEN:
        raise DFlashTrtError(f"--draft_tree {args.draft_tree}: EAGLE verifies at most {MAX_EAGLE_DRAFT_LEN} drafts")
    return draft_tree_nodes(args.draft_tree, drafter.block_size - 1, False) or None


def _curves(args: argparse.Namespace) -> None:
    target, drafter = _models(args)
    cal, cal_notes = _calibration(args)
    dep = _deployment(args, target, drafter, cal)
    notes: list[str] = []
    dflash_accs: list[Acceptance | None] = [None]
    if drafter is not None:
        accs, note = load_acceptance(args, drafter.block_size)
        dflash_accs = list(accs)
        notes.append(note)
    elif args.acceptance_length is not None or args.acceptance_json:
        raise DFlashTrtError("an acceptance distribution needs a drafter: pass --dflash_model_dir")
    extra = [] if args.eagle3_acceptance_length is None else [_eagle3_method(args, target)]
    conc = args.concurrency
    lengths = _lengths(args, DEFAULT_LENGTHS)
    limits = _limits(args, conc)
    schedule, schedule_rows = None, []
    tree = _draft_tree(args, drafter)
    if args.draft_len_schedule is not None:
        schedule, note = _schedule(args, target, drafter, dflash_accs, dep, lengths, limits, tree or 0)
        notes.append(note)
    variants = {}
    for dflash_acc in dflash_accs:
        dflash: list[Method] = []
        if dflash_acc is not None:
            one = Method(DFLASH, drafter, dflash_acc, schedule)
            dflash = [
                one if tree is None or drafter is None else tree_method(DFLASH, drafter, dflash_acc, tree, schedule)
            ]
        if tree is not None and dflash_acc is not None:
            notes.append(_tree_note(dflash[0], tree, dflash_acc))
        methods = [Method(AR), *dflash, *extra]
        feasible = {m.name: feasible_curve(m, target, dep, conc, lengths, limits) for m in methods}
        curves = {n: _ran(c) for n, c in feasible.items()}
        table, crossovers = [], {}
        if curves[AR]:  # nothing to compare against when not even AR's weights fit
            levels = args.levels or [p.tok_s_user for p in curves[AR]]
            table = speedup_table([p for c in curves.values() for p in c], AR, levels)
            ar_batches = {p.concurrency for p in curves[AR]}
            crossovers = {
                n: crossover_concurrency(c, curves[AR]).concurrency
                for n, c in curves.items()
                if n != AR and ar_batches & {p.concurrency for p in c}  # capped batches may share none
            }
        tau = "" if dflash_acc is None or len(dflash_accs) == 1 else f", tau {dflash_acc.mean():.2f}"
        variants[cal.name + tau] = (feasible, table, crossovers)
        if schedule is not None and drafter is not None and dflash_acc is not None:
            ran = [p.concurrency for p in curves[DFLASH]]
            ctx = mean_context(*lengths)
            rows = compare_schedule(target, drafter, dflash_acc, schedule, dep, ctx, ran, tree or 0)
            schedule_rows.append((tau, rows))
    notes += cal_notes
    if args.json:
        _emit_curves_json(variants, cal, notes, lengths, limits, schedule, schedule_rows)
    else:
        _emit_curves_text(args, variants, cal, notes, lengths, len(dflash_accs) > 1)
        if schedule is not None:
            _emit("\n".join(schedule_lines(schedule, schedule_rows)))


def _tree_note(method: Method, nodes: int, chain: Acceptance) -> str:
    """What a tree engine verifies and yields at one user (its schedule's budget there, else all its nodes)."""
    budget = method.tree_budget(1)
    return (
        f"draft trees of at most {nodes} nodes: at one user {budget + 1} target tokens verified per step, "
        f"{method.tokens_per_step(1):.2f} tokens per step (the chain's {chain.mean():.2f}) from the best static tree "
        f"over the chain's per-position rates, later ranks geometric (ratio {RESIDUAL_RATIO}, fitted on the tiny pair)"
    )


def _schedule(
    args: argparse.Namespace, target, drafter, accs, dep, lengths, limits, nodes: int
) -> tuple[DraftLenSchedule, str]:
    """The schedule the DFlash curves run under: `auto` derived for this deployment from the lowest acceptance
    planned (for a published range), or the table given; and a note saying which. On a draft-tree engine of
    `nodes` nodes its values are node budgets (draft_schedule.py)."""
    if drafter is None:
        raise DFlashTrtError("--draft_len_schedule plans a drafter: pass --dflash_model_dir or --preset")
    if args.max_draft_len is not None:
        raise DFlashTrtError("--max_draft_len fixes the draft length, --draft_len_schedule varies it: give one")
    if args.draft_len_schedule != AUTO:
        schedule = args.draft_len_schedule.fitted_to(nodes or drafter.block_size - 1)
        return schedule, f"draft-length schedule {schedule.text()} (given)"
    lowest = min(accs, key=lambda a: a.mean())
    derived = derive_schedule(target, drafter, lowest, dep, mean_context(*lengths), limits.max_batch_size, nodes)
    tree = f" --draft_tree {nodes}" if nodes else ""
    note = (
        f"draft-length schedule auto = {derived.schedule.text()} (batches 1..{limits.max_batch_size}, acceptance "
        f"length {lowest.mean():.2f}): dflash-trt build{tree} --draft_len_schedule {derived.schedule.text()}"
    )
    return derived.schedule, note


def schedule_lines(schedule: DraftLenSchedule, variants: list[tuple[str, tuple[ScheduleRow, ...]]]) -> list[str]:
    """The schedule against AR and the full draft length at each batch that runs."""
    lines = [f"draft-length schedule {schedule.text()}: output tok/s of the whole engine at each batch"]
    for label, rows in variants:
        if not rows:
            continue
        k_max = rows[0].fixed_draft_len
        if label:
            lines.append(f"[{label.lstrip(', ')}]")
        lines.append(
            f"{'batch':>6} {'drafts':>6} {'best':>5} {'ar':>10} {f'dflash full={k_max}':>17} {'scheduled':>10} "
            f"{'vs ar':>7} {'vs full':>8}"
        )
        for r in rows:
            lines.append(
                f"{r.batch:>6} {r.draft_len:>6} {r.best_draft_len:>5} {r.ar_tok_s:>10.0f} {r.fixed_tok_s:>17.0f} "
                f"{r.scheduled_tok_s:>10.0f} {r.scheduled_tok_s / r.ar_tok_s:>6.2f}x "
                f"{r.scheduled_tok_s / r.fixed_tok_s:>7.2f}x"
            )
    return lines


def _emit_curves_json(
    variants: dict[str, tuple],
    cal: Calibration,
    notes: list[str],
    lengths: tuple[int, int],
    limits: object,
    schedule: DraftLenSchedule | None,
    schedule_rows: list[tuple[str, tuple[ScheduleRow, ...]]],
) -> None:
    first = next(iter(variants.values()))[0]
    merged = {}
    for name, curve in first.items():
        rows = []
        for i, fp in enumerate(curve):
            row = fp.as_json()
            for key in ("tok_s_user", "tok_s_gpu"):
                vals = [r[0][name][i].as_json()[key] for r in variants.values()]
                row[key] = None if vals[0] is None else [min(vals), max(vals)]
            rows.append(row)
        merged[name] = rows
    _emit(
        strict_json(
            {
                "calibration": vars(cal),
                "error_band": cal.error_band,
                "notes": notes,
                "lengths": list(lengths),
                "limits": vars(limits),
                "curves": merged,
                "speedup_vs_ar": {
                    n: [{"tok_s_user": r.tok_s_user, "speedup": r.speedup} for r in t]
                    for n, (_, t, _) in variants.items()
                },
                "crossover_concurrency_vs_ar": {n: c for n, (_, _, c) in variants.items()},
                "draft_len_schedule": None
                if schedule is None
                else {
                    "schedule": schedule.text(),
                    "steps": schedule.as_json(),
                    "rows": {label or cal.name: [r.as_json() for r in rows] for label, rows in schedule_rows},
                },
                "caveat": BAND_CAVEAT,
            },
            indent=2,
        )
    )


def _emit_curves_text(
    args: argparse.Namespace,
    variants: dict[str, tuple],
    cal: Calibration,
    notes: list[str],
    lengths: tuple[int, int],
    acceptance_range: bool,
) -> None:
    first = next(iter(variants.values()))[0]
    weights = "16-bit" if args.qformat == NONE else args.qformat
    kv_cache = "16-bit" if args.kv_cache_dtype == NONE else args.kv_cache_dtype
    lines = [
        f"GPU {args.gpu} (--gpu), TP {args.tp_size}, {weights} weights (--qformat), {kv_cache} KV cache; "
        f"{lengths[0]}/{lengths[1]} tokens; tok/s/user = 1/TPOT",
        f"calibration {cal.name} ({cal.source})",
        band_text(cal),
        *notes,
    ]
    if acceptance_range:
        lines.append("each dflash cell spans the workload's lowest and highest published acceptance length")
    lines.append(f"{'method':<8} {'conc':>6} {'batch':>6} {'tok/s/user':>15} {'tok/s/GPU':>17}  fits")
    for name, curve in first.items():
        for i, fp in enumerate(curve):
            pts = [r[0][name][i].point for r in variants.values()]
            user = "-" if fp.point is None else _span([p.tok_s_user for p in pts if p])
            gpu = "-" if fp.point is None else _span([p.tok_s_gpu for p in pts if p])
            fits = "yes" if fp.fits else f"no: {fp.reason}"
            lines.append(f"{name:<8} {fp.requested:>6} {fp.batch:>6} {user:>15} {gpu:>17}  {fits}")
    lines.append("speedup = tok/s/GPU over ar's at equal interactivity (each method at its own concurrency):")
    for variant, (feasible, table, crossovers) in variants.items():
        curves = {n: _ran(c) for n, c in feasible.items()}
        for r in table:
            cells = ", ".join(
                speedup_cell(n, s, curves[n], r.tok_s_user, curves[AR]) for n, s in r.speedup.items() if n != AR
            )
            lines.append(f"[{variant}] at {r.tok_s_user:.1f} tok/s/user: {cells}")
        for name, c in crossovers.items():
            where = "> swept range" if c is None else f"{c:.1f}"
            lines.append(f"[{variant}] {name}: stops paying at concurrency {where}")
    lines.append(BAND_CAVEAT)
    _emit("\n".join(lines))


def _node(args: argparse.Namespace) -> None:
    from dflash_trt.analysis.node import parse_node, plan_node

    target, drafter = _models(args)
    _, gpu = parse_node(args.node)
    args.gpu = gpu
    cal, cal_notes = _calibration(args)
    methods: dict[str, list[Method]] = {AR: [Method(AR)]}
    notes = [f"calibration {cal.name} ({cal.source})", band_text(cal), *cal_notes]
    if drafter is not None:
        accs, note = load_acceptance(args, drafter.block_size)
        methods[DFLASH] = [Method(DFLASH, drafter, a) for a in accs]
        notes.append(note)
    if args.eagle3_acceptance_length is not None:
        methods[EAGLE3] = [_eagle3_method(args, target)]
    else:
        notes.append("eagle3: not planned (give --eagle3_acceptance_length)")
    lengths = _lengths(args, DEFAULT_LENGTHS)
    precision, kv = PRECISION[args.qformat], PRECISION[args.kv_cache_dtype]
    Deployment(get_gpu(gpu), precision, kv)  # refuses a precision the GPU lacks
    rows = plan_node(methods, target, args.node, precision, kv, cal, lengths, args.min_tok_s_user)
    if args.json:
        _emit(
            strict_json(
                {
                    "node": args.node,
                    "min_tok_s_user": args.min_tok_s_user,
                    "lengths": list(lengths),
                    "notes": notes,
                    "rows": [
                        {
                            "label": r.label,
                            "layouts": {n: None if lay is None else lay.as_json() for n, lay in r.layouts.items()},
                            "users_vs_ar": {n: r.ratio(n) for n in r.layouts if n != AR},
                        }
                        for r in rows
                    ],
                },
                indent=2,
            )
        )
        return
    lines = [
        f"{args.node} {args.qformat}, {lengths[0]}/{lengths[1]} tokens, every user at >= {args.min_tok_s_user:g} "
        "tok/s/user",
        *notes,
    ]
    for r in rows:
        lines.append(f"[{r.label}]")
        for name, lay in r.layouts.items():
            if lay is None:
                lines.append(f"  {name:<7} cannot give one user {args.min_tok_s_user:g} tok/s on any layout that fits")
                continue
            ratio = r.ratio(name)
            vs = "" if name == AR else (", AR serves none" if ratio is None else f", {ratio:.2f}x AR's users")
            lines.append(
                f"  {name:<7} tp {lay.tp} x {lay.replicas} replicas x {lay.batch} users = {lay.users} users, "
                f"{lay.tok_s_user:.0f} tok/s/user, {lay.tok_s_node:,.0f} tok/s/node (limit: {lay.limit}){vs}"
            )
    _emit("\n".join(lines))


EXTREME_RATIO = 10.0


def _concurrency_at(curve: list, tok_s_user: float) -> str:
    """The concurrency at which a predicted curve serves each user `tok_s_user`: a point, or the two it lies
    between (the speedup interpolates between them)."""
    by_concurrency = sorted(curve, key=lambda p: p.concurrency)
    fast = [p for p in by_concurrency if p.tok_s_user >= tok_s_user * (1 - 1e-9)]
    if not fast:
        return "-"
    last = fast[-1]
    slower = [p for p in by_concurrency if p.concurrency > last.concurrency]
    if abs(last.tok_s_user - tok_s_user) <= 1e-9 * tok_s_user or not slower:
        return str(last.concurrency)
    return f"{last.concurrency}..{slower[0].concurrency}"


def speedup_cell(name: str, speedup: float | None, curve: list, tok_s_user: float, ar_curve: list) -> str:
    """`dflash 4.09x (c=16..32 vs ar c=4)`; an extreme ratio says why in the same line."""
    if speedup is None:
        return f"{name} - (never this fast)"
    own, ar = _concurrency_at(curve, tok_s_user), _concurrency_at(ar_curve, tok_s_user)
    text = f"{name} {speedup:.2f}x (c={own} vs ar c={ar})"
    if speedup >= EXTREME_RATIO:
        ceiling = max(p.tok_s_user for p in ar_curve)
        text += (
            f": extreme because this speed is near ar's one-user ceiling ({ceiling:.0f} tok/s/user), where ar "
            "serves only a few users; it measures capacity at this speed, not faster tokens"
        )
    return text


def run(args: argparse.Namespace) -> int:
    if args.validate:
        _validate(args)
    elif args.provenance:
        _provenance(args)
    elif args.config:
        _capacity(args)
    elif args.calibrate:
        _calibrate(args)
    elif args.node:
        _node(args)
    else:
        _curves(args)
    return 0
