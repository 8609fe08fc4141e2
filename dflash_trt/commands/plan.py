"""`dflash-trt plan`: predicted latency/throughput curves for AR, EAGLE-3-like and DFlash before any GPU run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import KV_CACHE_DTYPES, NONE, QFORMATS
from dflash_trt.perf.gpus import GPUS, get_gpu
from dflash_trt.perf.model import PRECISION, Acceptance, Deployment, DFlashShape, Method, mean_context, predict_curve
from dflash_trt.perf.pareto import crossover_concurrency, speedup_table
from dflash_trt.perf.published import CALIBRATIONS, PRESETS, all_rows, fitted_calibration, markdown_table
from dflash_trt.perf.shapes import eagle3_like, load_models


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="predict tok/s/user and tok/s/GPU vs concurrency (roofline model)",
        description="Roofline prediction of AR, EAGLE-3-like and DFlash decoding on H100/H200/B200/B300 from model "
        "shapes and an acceptance-length distribution. --validate prints the model-vs-published table instead.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model_dir", help="target HF checkpoint folder (only config.json is read)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a published target + DFlash drafter pair")
    p.add_argument("--dflash_model_dir", help="DFlash drafter folder (z-lab format); with --model_dir")
    p.add_argument("--gpu", choices=sorted(GPUS), default="b200")
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--qformat", choices=QFORMATS, default=NONE, help="weight format (none = 16-bit weights)")
    p.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=NONE)
    p.add_argument("--acceptance_length", type=float, help="mean tokens per verify step incl. the bonus token")
    p.add_argument(
        "--acceptance_json",
        help='JSON with "histogram" (steps yielding 1..B tokens) or "per_position" (conditional acceptance rates)',
    )
    p.add_argument("--max_draft_len", type=int, help="draft fewer tokens than the drafter's block (block - 1)")
    p.add_argument("--eagle3_acceptance_length", type=float, help="also predict an EAGLE-3-like drafter")
    p.add_argument("--eagle3_steps", type=int, default=3)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256", help="comma-separated list")
    p.add_argument("--isl", type=int, default=1024, help="mean input length (tokens)")
    p.add_argument("--osl", type=int, default=1024, help="mean output length (tokens)")
    p.add_argument("--calibration", choices=sorted(CALIBRATIONS), default="trtllm", help="fitted overheads to use")
    p.add_argument("--levels", help="comma-separated tok/s/user values for the speedup-vs-AR table")
    p.add_argument("--validate", action="store_true", help="print the model-vs-published table and exit")
    p.add_argument("--json", action="store_true", help="print machine-readable output")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DFlashTrtError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise DFlashTrtError(f"{what} must list positive integers, got {text!r}")
    return values


def load_acceptance(args: argparse.Namespace, block: int) -> Acceptance:
    if (args.acceptance_length is None) == (args.acceptance_json is None):
        raise DFlashTrtError("give exactly one of --acceptance_length and --acceptance_json")
    if args.acceptance_json:
        path = Path(args.acceptance_json)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DFlashTrtError(f"cannot read acceptance file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise DFlashTrtError(f"{path} must hold a JSON object")
        if "histogram" in data:
            acc = Acceptance.from_histogram(data["histogram"])
        elif "per_position" in data:
            acc = Acceptance.from_position_rates(data["per_position"])
        else:
            raise DFlashTrtError(f"{path} needs a 'histogram' or 'per_position' list")
        if acc.max_length > block:
            raise DFlashTrtError(f"{path} describes blocks of {acc.max_length} tokens; the drafter's block is {block}")
    else:
        acc = Acceptance.from_mean(args.acceptance_length, block)
    if args.max_draft_len is not None:
        if not 1 <= args.max_draft_len < block:
            raise DFlashTrtError(f"--max_draft_len must lie in [1, {block - 1}]")
        acc = acc.truncated(args.max_draft_len + 1)
    return acc


def run(args: argparse.Namespace) -> int:
    if args.validate:
        calibrations, rows = all_rows()
        if args.json:
            print(json.dumps({"calibrations": {k: vars(v) for k, v in calibrations.items()},
                              "rows": [vars(r) | {"error": r.error} for r in rows]}, indent=2))  # fmt: skip
        else:
            print(markdown_table(rows))
        return 0
    drafter: DFlashShape | None
    if args.preset:
        target, drafter = PRESETS[args.preset]()
    elif args.model_dir:
        target, drafter = load_models(args.model_dir, args.dflash_model_dir)
    else:
        raise DFlashTrtError("give --model_dir (with --dflash_model_dir) or --preset")
    dep = Deployment(
        get_gpu(args.gpu), PRECISION[args.qformat], PRECISION[args.kv_cache_dtype], args.tp_size,
        fitted_calibration(args.calibration),
    )  # fmt: skip
    methods = [Method("ar")]
    if drafter is not None:
        methods.append(Method("dflash", drafter, load_acceptance(args, drafter.block_size)))
    elif args.acceptance_length is not None or args.acceptance_json:
        raise DFlashTrtError("an acceptance distribution needs a drafter: pass --dflash_model_dir")
    if args.eagle3_acceptance_length is not None:
        acc = Acceptance.from_mean(args.eagle3_acceptance_length, args.eagle3_steps + 1)
        methods.append(Method("eagle3", eagle3_like(target, args.eagle3_steps), acc))
    conc = _ints(args.concurrency, "--concurrency")
    ctx = mean_context(args.isl, args.osl)
    curves = {m.name: predict_curve(m, target, dep, conc, ctx) for m in methods}
    points = [p for curve in curves.values() for p in curve]
    levels = [float(v) for v in args.levels.split(",")] if args.levels else [p.tok_s_user for p in curves["ar"]]
    table = speedup_table(points, "ar", levels)
    crossovers = {n: crossover_concurrency(c, curves["ar"]).concurrency for n, c in curves.items() if n != "ar"}
    if args.json:
        print(json.dumps({
            "calibration": vars(dep.calibration),
            "curves": {n: [vars(p) for p in c] for n, c in curves.items()},
            "speedup_vs_ar": [{"tok_s_user": r.tok_s_user, "speedup": r.speedup} for r in table],
            "crossover_concurrency_vs_ar": crossovers,
        }, indent=2))  # fmt: skip
        return 0
    print(f"{args.gpu} x{args.tp_size} {args.qformat}, calibration {args.calibration}; tok/s/user = 1/TPOT")
    print(f"{'method':<8} {'conc':>6} {'tok/s/user':>11} {'tok/s/GPU':>11}")
    for name, curve in curves.items():
        for p in curve:
            print(f"{name:<8} {p.concurrency:>6} {p.tok_s_user:>11.1f} {p.tok_s_gpu:>11.1f}")
    for r in table:
        cells = ", ".join(f"{n} {'-' if s is None else f'{s:.2f}x'}" for n, s in r.speedup.items() if n != "ar")
        print(f"at {r.tok_s_user:.1f} tok/s/user vs ar: {cells}")
    for name, c in crossovers.items():
        print(f"{name}: stops paying at concurrency {'> swept range' if c is None else f'{c:.1f}'}")
    return 0
