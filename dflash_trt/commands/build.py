"""`dflash-trt build`: one TensorRT-LLM 1.2.x engine (target + drafter) from a converted checkpoint.

Flags mirror `trtllm-build`. `--dry_run` validates and prints the exact `trtllm-build` command, the BuildConfig,
the manifest and why the engine records a longer max_seq_len than the one given, and needs no GPU; a real run needs
TensorRT-LLM 1.2.x and the plugin library.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from dflash_trt.checkpoint.atomic import check_output_apart
from dflash_trt.commands.build_profile import add_profile_arguments, run_profile
from dflash_trt.commands.schedule_flags import add_schedule_arguments, schedule_for_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.gpu_targets import GPU_SMS, resolve_gpu
from dflash_trt.inputs import DRAFT_TREE, POSITIVE_INT, WORKERS, IntRange
from dflash_trt.trtllm.attention_route import route_summary
from dflash_trt.trtllm.build_limits import GEMM_PLUGIN_CHOICES, KV_CACHE_TYPES, LOGITS_DTYPES, MAX_EAGLE_BATCH_SIZE
from dflash_trt.trtllm.build_plan import plan_engine_build
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.engine_lengths import fit_lengths

SWITCH = ("enable", "disable")
# Flags whose value lands unchanged in EngineBuildSettings; each defaults to None so only what the user typed
# overrides the base settings. The ranges here are the type's; the plan checks them against the model and EAGLE.
SETTING_FLAGS: dict[str, IntRange] = {
    "max_batch_size": IntRange(1, MAX_EAGLE_BATCH_SIZE),
    "max_input_len": POSITIVE_INT,
    "max_seq_len": POSITIVE_INT,
    "max_num_tokens": POSITIVE_INT,
    "max_beam_width": POSITIVE_INT,
    "tokens_per_block": POSITIVE_INT,
    "workers": WORKERS,
    "draft_tree": DRAFT_TREE,
}
DERIVED_DEFAULTS = {
    "max_seq_len": "min(8192, the target's max_position_embeddings less 3 x max_draft_len: the positions the engine's "
    "longest requests reach; a sliding-window drafter's window bounds nothing)",
    "max_input_len": "min(4096, --max_seq_len)",
    "max_num_tokens": f"min({EngineBuildSettings.max_num_tokens}, --max_seq_len x --max_batch_size: what "
    "TensorRT-LLM's builder clips it to)",
    "draft_tree": "the chain, block_size - 1 drafts (with --config: the profile's engine.draft_tree); N more builds "
    "an engine verifying a draft tree of N nodes per request (its EAGLE max_draft_len)",
}
SWITCH_FLAGS = ("use_paged_context_fmha", "use_fp8_context_fmha", "multiple_profiles")


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = EngineBuildSettings()
    parser = subparsers.add_parser(
        "build",
        help="build one TensorRT-LLM 1.2.x engine (target + DFlash drafter) from a converted checkpoint",
        description=__doc__,
    )
    parser.add_argument("--checkpoint_dir", help="converted checkpoint (dflash-trt convert); not with --config")
    parser.add_argument("--output_dir", help="engine directory to create (with --config: the workspace)")
    add_profile_arguments(parser)
    for name, kind in SETTING_FLAGS.items():
        shown = DERIVED_DEFAULTS.get(name, getattr(defaults, name))
        parser.add_argument(f"--{name}", type=kind, default=None, help=f"default {shown}")
    for name in SWITCH_FLAGS:
        parser.add_argument(
            f"--{name}",
            choices=SWITCH,
            default=None,
            help=f"default {'enable' if getattr(defaults, name) else 'disable'}",
        )
    parser.add_argument(
        "--gemm_plugin", choices=GEMM_PLUGIN_CHOICES, default=None, help=f"default {defaults.gemm_plugin}"
    )
    parser.add_argument("--kv_cache_type", choices=KV_CACHE_TYPES, default=None, help="default paged")
    parser.add_argument("--logits_dtype", choices=LOGITS_DTYPES, default=None, help="default float32")
    parser.add_argument(
        "--gpu",
        choices=tuple(GPU_SMS),
        default=None,
        help="the GPU the engine is for, which decides the attention kernel of each pass and prices "
        "--draft_len_schedule auto (default: this host's GPU, else an assumed one, said so; with --config: the "
        "profile's gpu)",
    )
    parser.add_argument(
        "--plugin_library",
        default=None,
        help="libdflash_trt_plugins.so (default: $DFLASH_TRT_PLUGIN_LIB, else plugins/build)",
    )
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="validate and print the trtllm-build command and BuildConfig; build nothing",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an --output_dir an earlier dflash-trt build wrote"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_schedule_arguments(parser, "none; with --config, the profile's", gpu_flag=False)
    parser.add_argument(
        "extra_flags", nargs=argparse.REMAINDER, help="after `--`: further trtllm-build flags, passed through verbatim"
    )
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace, base: EngineBuildSettings | None = None) -> EngineBuildSettings:
    """Flags the user typed override `base` (the built-in defaults, or a build profile's settings)."""
    changes: dict = {name: getattr(args, name) for name in SETTING_FLAGS if getattr(args, name) is not None}
    changes.update({name: getattr(args, name) == "enable" for name in SWITCH_FLAGS if getattr(args, name)})
    for name in ("gemm_plugin", "kv_cache_type", "logits_dtype"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    extra = [flag for flag in args.extra_flags if flag != "--"]
    if extra:
        changes["extra_flags"] = tuple(extra)
    if base is not None and args.gpu is not None and args.gpu != base.gpu:
        raise DFlashTrtError(f"the profile is for {base.gpu}; --gpu {args.gpu} would build it for another GPU")
    return dataclasses.replace(base or EngineBuildSettings(), **changes)


def readable_json(value: object, level: int = 0) -> str:
    """Indented JSON whose lists without objects stay on one line (a draft chain's `eagle_choices` is one line,
    not hundreds)."""
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {readable_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(inner + readable_json(v, level + 1) for v in value) + f"\n{pad}]"
    return json.dumps(value)


def run(args: argparse.Namespace) -> int:
    if args.config:
        return run_profile(args, settings_override=settings_from_args)
    if args.checkpoint_dir is None or args.output_dir is None:
        raise DFlashTrtError("give --checkpoint_dir and --output_dir, or a build profile with --config")
    check_output_apart(
        args.output_dir, {"--checkpoint_dir": args.checkpoint_dir, "--plugin_library": args.plugin_library}
    )
    gpu, chosen = resolve_gpu(args.gpu)
    settings = fit_lengths(
        args.checkpoint_dir,
        dataclasses.replace(settings_from_args(args), gpu=gpu),
        args.max_seq_len,
        args.max_input_len,
        args.max_num_tokens,
    )
    schedule = schedule_for_checkpoint(args, Path(args.checkpoint_dir), settings.max_batch_size, gpu_flag=False)
    settings = dataclasses.replace(settings, draft_len_schedule=schedule)
    plan = plan_engine_build(args.checkpoint_dir, args.output_dir, settings, plugin_library=args.plugin_library)
    route = route_summary(gpu, plan.dflash_manifest["attention"])
    if args.dry_run:
        if args.json:
            print(json.dumps({**plan.to_dict(), "gpu_chosen": chosen}, indent=2))
        else:
            print(f"# GPU: {gpu} ({chosen})")
            print("\n".join(f"# {line}" for line in route))
            print("# trtllm-build command")
            print(plan.shell_command(with_library=True))
            print("# BuildConfig (as trtllm-build passes it to BuildConfig.from_dict)")
            print(readable_json(plan.build_config))
            print("# dflash_trt.json")
            print(readable_json(plan.dflash_manifest))
            print("# lengths")
            print(plan.lengths.explanation())
        return 0
    from dflash_trt.trtllm.build import run_engine_build

    if not args.json:
        print("\n".join([f"GPU: {gpu} ({chosen})", *route]), flush=True)
    engine_dir = run_engine_build(plan, overwrite=args.overwrite)
    if args.json:
        print(json.dumps({"engine_dir": str(engine_dir), **plan.to_dict()}, indent=2))
    else:
        print(f"engine written to {engine_dir}")
    return 0
