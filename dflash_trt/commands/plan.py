"""`dflash-trt plan`: predicted throughput curves, capacity of a build profile, and the model's own evidence.

Modes: curves for a target + drafter (`--preset` or `--model_dir`); `--config P` for the memory budget and the
sequences a profile's engine holds; `--validate` for the model against every published point (fit/eval split);
`--provenance` for where each constant comes from; `--calibrate results.json` to fit the overheads to one's own
`dflash-trt bench` results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import KV_CACHE_DTYPES, NONE, QFORMATS
from dflash_trt.perf.evaluation import HARNESSES, calibration
from dflash_trt.perf.gpus import GPUS, get_gpu
from dflash_trt.perf.model import (
    PRECISION,
    Acceptance,
    Calibration,
    Deployment,
    DFlashShape,
    Method,
    TargetShape,
    mean_context,
    predict_curve,
)
from dflash_trt.perf.pareto import crossover_concurrency, speedup_table
from dflash_trt.perf.published import PAIRS, pair_for_models
from dflash_trt.perf.shapes import eagle3_like, load_models
from dflash_trt.profiles import check_tp_heads, load_profile

DEFAULT_LENGTHS = (1024, 1024)
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
    p.add_argument("--dflash_model_dir", help="DFlash drafter folder (z-lab format); with --model_dir")
    p.add_argument("--gpu", choices=sorted(GPUS), default="b200")
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--qformat", choices=QFORMATS, default=NONE, help="weight format (none = 16-bit weights)")
    p.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=NONE)
    p.add_argument(
        "--acceptance_length",
        type=float,
        help="mean tokens per verify step incl. the bonus token (default with --preset: the published value)",
    )
    p.add_argument(
        "--acceptance_json",
        help='JSON with "histogram" (steps yielding 1..B tokens) or "per_position" (conditional acceptance rates)',
    )
    p.add_argument("--max_draft_len", type=int, help="draft fewer tokens than the drafter's block (block - 1)")
    p.add_argument("--eagle3_acceptance_length", type=float, help="also predict an EAGLE-3-like drafter")
    p.add_argument("--eagle3_steps", type=int, default=3)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256", help="comma-separated list")
    p.add_argument("--isl", type=int, help="mean input length in tokens (default 1024; --config: the sweep's)")
    p.add_argument("--osl", type=int, help="mean output length in tokens (default 1024; --config: the sweep's)")
    p.add_argument("--calibration", choices=HARNESSES, default="trtllm", help="which fitted overheads to use")
    p.add_argument("--levels", help="comma-separated tok/s/user values for the speedup-vs-AR table")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--config", help="build profile YAML: print its memory budget and the sequences that fit")
    what.add_argument(
        "--calibrate", metavar="RESULTS_JSON", help="fit the overheads to a `dflash-trt bench` results.json"
    )
    what.add_argument("--validate", action="store_true", help="print the model vs every published point and exit")
    what.add_argument("--provenance", action="store_true", help="print every constant's value, kind and source")
    p.add_argument("--json", action="store_true", help="print machine-readable output")
    p.set_defaults(func=run)


def _emit(text: str) -> None:
    """Write to stdout; a reader that closes early (`| head`) is one clear error, not a traceback."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise DFlashTrtError("standard output was closed before the output was written (broken pipe)") from None


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DFlashTrtError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise DFlashTrtError(f"{what} must list positive integers, got {text!r}")
    return values


def _levels(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DFlashTrtError(f"--levels must be comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise DFlashTrtError(f"--levels must list positive finite numbers, got {text!r}")
    return values


def _lengths(args: argparse.Namespace, default: tuple[int, int]) -> tuple[int, int]:
    isl = default[0] if args.isl is None else args.isl
    osl = default[1] if args.osl is None else args.osl
    if isl < 1 or osl < 1:
        raise DFlashTrtError(f"--isl and --osl must be positive token counts, got {isl} and {osl}")
    return isl, osl


def load_acceptance(
    args: argparse.Namespace, block: int, published: tuple[float, str] | None
) -> tuple[Acceptance, str]:
    """The DFlash acceptance distribution and a note saying where it came from."""
    if args.acceptance_length is not None and args.acceptance_json is not None:
        raise DFlashTrtError("give at most one of --acceptance_length and --acceptance_json")
    if args.acceptance_json:
        path = Path(args.acceptance_json)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DFlashTrtError(f"cannot read acceptance file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise DFlashTrtError(f"{path} must hold a JSON object")
        values = data.get("histogram", data.get("per_position"))
        if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise DFlashTrtError(f"{path} needs a 'histogram' or 'per_position' list of numbers")
        acc = Acceptance.from_histogram(values) if "histogram" in data else Acceptance.from_position_rates(values)
        if acc.max_length > block:
            raise DFlashTrtError(f"{path} describes blocks of {acc.max_length} tokens; the drafter's block is {block}")
        note = f"acceptance from {path}"
    elif args.acceptance_length is not None:
        acc, note = Acceptance.from_mean(args.acceptance_length, block), "acceptance length given"
    elif published is not None:
        acc = Acceptance.from_mean(published[0], block)
        note = f"acceptance length {published[0]} published for this pair ({published[1]})"
    else:
        raise DFlashTrtError(
            "no acceptance length is published for this pair: give --acceptance_length or "
            "--acceptance_json (e.g. measured by `dflash-trt bench`)"
        )
    if args.max_draft_len is not None:
        if not 1 <= args.max_draft_len < block:
            raise DFlashTrtError(f"--max_draft_len must lie in [1, {block - 1}]")
        acc = acc.truncated(args.max_draft_len + 1)
    return acc, note


def _check_tp(target: TargetShape, drafter: DFlashShape | None, tp: int) -> None:
    if tp < 1:
        raise DFlashTrtError(f"--tp_size must be a positive integer, got {tp}")
    check_tp_heads("target", target.stack.num_heads, target.stack.num_kv_heads, tp)
    if drafter is not None:
        check_tp_heads("drafter", drafter.stack.num_heads, drafter.stack.num_kv_heads, tp)


def _models(args: argparse.Namespace) -> tuple[TargetShape, DFlashShape | None]:
    if args.preset:
        return PAIRS[args.preset].load()
    if args.model_dir:
        return load_models(args.model_dir, args.dflash_model_dir)
    raise DFlashTrtError("give --model_dir (with --dflash_model_dir), --preset or --config")


def _validate(args: argparse.Namespace) -> None:
    from dflash_trt.perf import evaluation

    rows = evaluation.evaluate()
    if args.json:
        _emit(json.dumps([r.as_json() for r in rows], indent=2))
    else:
        shape = evaluation.markdown_band_shape(evaluation.band_shape())
        _emit(f"{evaluation.markdown_tables(rows)}\n\nShape of the >15x claim (gpt-oss-120b, 8x B300, MXFP4):\n{shape}")


def _provenance(args: argparse.Namespace) -> None:
    from dflash_trt import provenance

    table = provenance.as_json()
    if args.json:
        _emit(json.dumps(table, indent=2))
        return
    _emit("\n".join(f"{name}\t{c['value']}\t{c['kind']}\t{c['source']}" for name, c in table.items()))


def _profile_models_on_disk(profile) -> tuple[TargetShape, DFlashShape]:
    """Shapes of a profile's models that are local folders (or already in the HF cache): their config.json."""
    from dflash_trt.profiles import resolve_model_dir

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
    from dflash_trt.capacity import capacity_warnings, describe, plan_capacity

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
    if args.json:
        _emit(json.dumps({"profile": profile.name, "capacity": cap.as_json(), "warnings": warnings}, indent=2))
    else:
        _emit(describe(profile, cap))
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)


def _deployment(args: argparse.Namespace, target: TargetShape, drafter: DFlashShape | None, cal: Calibration):
    _check_tp(target, drafter, args.tp_size)
    return Deployment(get_gpu(args.gpu), PRECISION[args.qformat], PRECISION[args.kv_cache_dtype], args.tp_size, cal)


def _calibrate(args: argparse.Namespace) -> None:
    from dflash_trt.perf.calibrate import fit, read_bench_points

    target, drafter = _models(args)
    points = read_bench_points(args.calibrate)
    dep = _deployment(args, target, drafter, Calibration("measured"))
    cal, residuals = fit(points, target, drafter, dep, mean_context(*_lengths(args, DEFAULT_LENGTHS)), args.calibrate)
    if args.json:
        _emit(
            json.dumps(
                {
                    "calibration": vars(cal),
                    "residuals": [
                        vars(r.point) | {"predicted_tok_s_user": r.predicted_tok_s_user, "error": r.error}
                        for r in residuals
                    ],
                },
                indent=2,
            )
        )
        return
    head = f"calibration: step_overhead_s {cal.step_overhead_s:.6f}, spec_overhead_s {cal.spec_overhead_s:.6f}"
    columns = f"{'mode':<8} {'conc':>6} {'tau':>6} {'measured':>10} {'model':>10} {'error':>8}"
    lines = [f"{head} ({cal.source})", columns]
    for r in residuals:
        p = r.point
        lines.append(
            f"{p.mode:<8} {p.concurrency:>6} {p.acceptance_length:>6.2f} {p.tok_s_user:>10.1f} "
            f"{r.predicted_tok_s_user:>10.1f} {100 * r.error:>+7.1f}%"
        )
    _emit("\n".join(lines))


def _curves(args: argparse.Namespace) -> None:
    target, drafter = _models(args)
    dep = _deployment(args, target, drafter, calibration(args.calibration))
    methods, notes = [Method("ar")], []
    if drafter is not None:
        pair = PAIRS[args.preset] if args.preset else None
        published = (pair.tau, pair.tau_source) if pair is not None and pair.tau is not None else None
        acc, note = load_acceptance(args, drafter.block_size, published)
        methods.append(Method("dflash", drafter, acc))
        notes.append(note)
    elif args.acceptance_length is not None or args.acceptance_json:
        raise DFlashTrtError("an acceptance distribution needs a drafter: pass --dflash_model_dir")
    if args.eagle3_acceptance_length is not None:
        if args.eagle3_steps < 1:
            raise DFlashTrtError(f"--eagle3_steps must be a positive integer, got {args.eagle3_steps}")
        acc = Acceptance.from_mean(args.eagle3_acceptance_length, args.eagle3_steps + 1)
        methods.append(Method("eagle3", eagle3_like(target, args.eagle3_steps), acc))
    conc = _ints(args.concurrency, "--concurrency")
    ctx = mean_context(*_lengths(args, DEFAULT_LENGTHS))
    curves = {m.name: predict_curve(m, target, dep, conc, ctx) for m in methods}
    points = [p for curve in curves.values() for p in curve]
    levels = _levels(args.levels) if args.levels else [p.tok_s_user for p in curves["ar"]]
    table = speedup_table(points, "ar", levels)
    crossovers = {n: crossover_concurrency(c, curves["ar"]).concurrency for n, c in curves.items() if n != "ar"}
    if args.json:
        _emit(
            json.dumps(
                {
                    "calibration": vars(dep.calibration),
                    "notes": notes,
                    "curves": {n: [vars(p) for p in c] for n, c in curves.items()},
                    "speedup_vs_ar": [{"tok_s_user": r.tok_s_user, "speedup": r.speedup} for r in table],
                    "crossover_concurrency_vs_ar": crossovers,
                    "caveat": BAND_CAVEAT,
                },
                indent=2,
            )
        )
        return
    weights = "16-bit" if args.qformat == NONE else args.qformat
    kv_cache = "16-bit" if args.kv_cache_dtype == NONE else args.kv_cache_dtype
    lines = [
        f"GPU {args.gpu} (--gpu), TP {args.tp_size}, {weights} weights (--qformat), {kv_cache} KV cache; "
        f"calibration {dep.calibration.name} ({dep.calibration.source}); tok/s/user = 1/TPOT",
        *notes,
        f"{'method':<8} {'conc':>6} {'tok/s/user':>11} {'tok/s/GPU':>11}",
    ]
    for name, curve in curves.items():
        lines += [f"{name:<8} {p.concurrency:>6} {p.tok_s_user:>11.1f} {p.tok_s_gpu:>11.1f}" for p in curve]
    lines.append("speedup = tok/s/GPU over ar's at equal interactivity (each method at its own concurrency):")
    for r in table:
        cells = ", ".join(
            speedup_cell(n, s, curves[n], r.tok_s_user, curves["ar"]) for n, s in r.speedup.items() if n != "ar"
        )
        lines.append(f"at {r.tok_s_user:.1f} tok/s/user: {cells}")
    for name, c in crossovers.items():
        lines.append(f"{name}: stops paying at concurrency {'> swept range' if c is None else f'{c:.1f}'}")
    lines.append(BAND_CAVEAT)
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
    else:
        _curves(args)
    return 0
