"""`dflash-trt triton`: write a Triton model repository (ensemble, pre/post-processing, tensorrt_llm) for a DFlash
engine, with a launch script that preloads the plugin library and a streaming gRPC client.

Give `--engine_dir` for a built engine, or `--config PROFILE` to lay the repository out for the engine that profile
will build (so deployment can be reviewed before the build), or `--checkpoint_dir` for a converted checkpoint: a
CPU-served repository whose `tensorrt_llm` model runs the engine network under the emulation with the same
interface, so clients and ensembles can be developed and tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import DRAFT_TREE, MEMORY_FRACTION, POSITIVE_INT, IntRange
from dflash_trt.jsonfile import strict_json
from dflash_trt.prompts import CHAT_TEMPLATE_KWARGS_HELP, parse_chat_template_kwargs
from dflash_trt.triton.serving import MAX_REPLICAS, ServingSettings, override_serving
from dflash_trt.trtllm.build_limits import MAX_EAGLE_BATCH_SIZE

CPU_MAX_BATCH_SIZE = 8  # --checkpoint_dir's default


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "triton", help="write a Triton model repository for a DFlash engine", description=__doc__
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--engine_dir", help="engine built by dflash-trt build")
    source.add_argument("--config", help="build profile; the repository points at the engine it will build")
    source.add_argument(
        "--checkpoint_dir", help="converted checkpoint (TP 1): a CPU-served repository running the emulated engine"
    )
    parser.add_argument(
        "--tokenizer_dir",
        default=None,
        help="HF tokenizer directory (required with --engine_dir and --checkpoint_dir; overrides the profile's)",
    )
    parser.add_argument(
        "--max_batch_size",
        type=IntRange(1, MAX_EAGLE_BATCH_SIZE),
        default=None,
        help=f"with --checkpoint_dir: requests decoded together (default {CPU_MAX_BATCH_SIZE})",
    )
    parser.add_argument(
        "--max_seq_len",
        type=POSITIVE_INT,
        default=None,
        help="with --checkpoint_dir: prompt + output tokens per request (default: the target's context, at most 2048)",
    )
    parser.add_argument(
        "--draft_tree",
        type=DRAFT_TREE,
        default=None,
        help="with --checkpoint_dir: the emulated engine verifies draft trees of N nodes (as `build --draft_tree N`; "
        "default the chain); an engine or a profile fixes its own",
    )
    parser.add_argument("--output_dir", required=True, help="model repository to create")
    parser.add_argument(
        "--work_dir", default=None, help="with --config: the build workspace (default out/<profile name>)"
    )
    parser.add_argument("--hf_cache", default=None, help="with --config: HF hub cache holding the tokenizer")
    parser.add_argument(
        "--download",
        action="store_true",
        help="with --config: download the tokenizer's model if it is not in the HF cache",
    )
    parser.add_argument(
        "--plugin_library", default=None, help="with --config: libdflash_trt_plugins.so the launch script preloads"
    )
    _add_serving_arguments(parser)
    parser.add_argument(
        "--path_map",
        action="append",
        default=[],
        metavar="HERE=THERE",
        help="write paths under HERE as THERE: for a repository served on a host that mounts the engine, checkpoint, "
        "tokenizer or plugin elsewhere (repeatable; both absolute)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an --output_dir an earlier dflash-trt triton wrote"
    )
    parser.add_argument("--json", action="store_true", help="print the repository settings as JSON")
    parser.set_defaults(func=run)


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving knobs; each defaults to None so only what the user typed overrides the profile's."""
    defaults = ServingSettings()
    parser.add_argument(
        "--kv_cache_free_gpu_mem_fraction",
        type=MEMORY_FRACTION,
        default=None,
        help="share of free GPU memory for the KV cache (default: the profile's with --config, else "
        f"{defaults.kv_cache_free_gpu_mem_fraction})",
    )
    parser.add_argument(
        "--batch_scheduler_policy",
        choices=("guaranteed_no_evict", "max_utilization"),
        default=None,
        help=f"default: the profile's with --config, else {defaults.batch_scheduler_policy}",
    )
    parser.add_argument(
        "--instance_count",
        type=POSITIVE_INT,
        default=None,
        help=f"pre/post-processing model instances (default: the profile's with --config, else "
        f"{defaults.instance_count})",
    )
    parser.add_argument("--chat_template_kwargs", default=None, help=CHAT_TEMPLATE_KWARGS_HELP)
    parser.add_argument(
        "--replicas",
        type=IntRange(1, MAX_REPLICAS),
        default=None,
        help="copies of the engine on one node, each on its own tp_size GPUs (tensorrtllm orchestrator mode; "
        f"default: the profile's with --config, else {defaults.replicas})",
    )


def _tokenizer_dir(path: str) -> Path:
    """A directory whose tokenizer loads as the repository's Python models will load it (corrupt files refused)."""
    from dflash_trt.tokenizer import load_tokenizer

    directory = Path(path)
    if load_tokenizer(directory) is None:
        raise DFlashTrtError(f"{directory} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    return directory


def _check_profile_tokenizer(tokenizer: Path, target: str) -> None:
    """The tokenizer against the vocabulary recorded for the profile's target (when it is recorded)."""
    from dflash_trt.recorded_configs import packaged_recorded_configs
    from dflash_trt.triton.repository import check_tokenizer

    recorded = packaged_recorded_configs().get(target)
    vocab_size = recorded.get("vocab_size") if isinstance(recorded, dict) else None
    if isinstance(vocab_size, int):
        check_tokenizer(tokenizer, vocab_size, f"the profile's target {target}")


def _path_map(items: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        here, sep, there = item.partition("=")
        if not sep or not here.startswith("/") or not there.startswith("/"):
            raise DFlashTrtError(f"--path_map {item!r}: expected HERE=THERE, two absolute paths")
        pairs.append((here, there))
    return pairs


def _serving(args: argparse.Namespace, base: ServingSettings) -> ServingSettings:
    """`base` with the serving flags the user typed, checked by the build profile schema."""
    names = ("kv_cache_free_gpu_mem_fraction", "batch_scheduler_policy", "instance_count", "replicas")
    return override_serving(base, {name: getattr(args, name) for name in names if getattr(args, name) is not None})


def run(args: argparse.Namespace) -> int:
    from dflash_trt.triton.repository import (
        relocated,
        settings_from_checkpoint,
        settings_from_engine,
        write_repository,
    )

    chat_kwargs = json.dumps(parse_chat_template_kwargs(args.chat_template_kwargs) or {})

    for flag in ("max_batch_size", "max_seq_len", "draft_tree"):
        if getattr(args, flag) is not None and not args.checkpoint_dir:
            raise DFlashTrtError(f"--{flag} applies to --checkpoint_dir only (an engine fixes its own)")
    if args.engine_dir or args.checkpoint_dir:
        if args.tokenizer_dir is None:
            raise DFlashTrtError(
                f"--tokenizer_dir is required with {'--engine_dir' if args.engine_dir else '--checkpoint_dir'}"
            )
        serving = _serving(args, ServingSettings())
        tokenizer = _tokenizer_dir(args.tokenizer_dir)
        if args.engine_dir:
            settings = settings_from_engine(args.engine_dir, tokenizer, serving)
        else:
            settings = settings_from_checkpoint(
                args.checkpoint_dir,
                tokenizer,
                CPU_MAX_BATCH_SIZE if args.max_batch_size is None else args.max_batch_size,
                args.max_seq_len,
                serving,
                args.draft_tree,
            )
    else:
        from dflash_trt.pipeline.profiles import load_profile, resolve_model_dir
        from dflash_trt.pipeline.settings import settings_from_profile
        from dflash_trt.pipeline.workspace import workspace
        from dflash_trt.trtllm.plugin import default_library_path

        profile = load_profile(args.config)
        if args.tokenizer_dir:
            tokenizer = _tokenizer_dir(args.tokenizer_dir)
        else:
            cache = Path(args.hf_cache) if args.hf_cache else None
            model_dir = resolve_model_dir(profile.model.tokenizer_source, cache_dir=cache, allow_download=args.download)
            tokenizer = _tokenizer_dir(str(model_dir))
        _check_profile_tokenizer(tokenizer, profile.model.target)
        library = args.plugin_library or default_library_path()
        settings = settings_from_profile(
            profile, workspace(profile, args.work_dir).engine, tokenizer, library, _serving(args, profile.serving)
        )
    settings = replace(settings, chat_template_kwargs=chat_kwargs)
    local = {
        "--engine_dir": settings.engine_dir or None,
        "--checkpoint_dir": settings.checkpoint_dir or None,
        "--config": args.config,
    }
    settings = relocated(settings, _path_map(args.path_map))
    path = write_repository(settings, args.output_dir, overwrite=args.overwrite, inputs=local)
    if args.json:
        print(strict_json({"repository": str(path), **asdict(settings)}, indent=2))
    else:
        print(f"Triton repository written to {path}")
        print(f"start it with: {path / 'launch_triton.sh'}")
        print("               (TRITONSERVER=/path/to/tritonserver when it is not on PATH; `make tritonserver` puts")
        print("               a CPU one at .tritonserver/tritonserver in this repository)")
        print(f"then:          {sys.executable} {path / 'client.py'} --prompt 'Hello'")
    return 0
