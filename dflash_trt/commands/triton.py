"""`dflash-trt triton`: write a Triton model repository (ensemble, pre/post-processing, tensorrt_llm) for a DFlash
engine, with a launch script that preloads the plugin library and a streaming gRPC client.

Give `--engine_dir` for a built engine, or `--config PROFILE` to lay the repository out for the engine that profile
will build (so deployment can be reviewed before the build).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import strict_json
from dflash_trt.prompts import CHAT_TEMPLATE_KWARGS_HELP, parse_chat_template_kwargs
from dflash_trt.triton.serving import ServingSettings, override_serving


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = ServingSettings()
    parser = subparsers.add_parser(
        "triton", help="write a Triton model repository for a DFlash engine", description=__doc__
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--engine_dir", help="engine built by dflash-trt build")
    source.add_argument("--config", help="build profile; the repository points at the engine it will build")
    parser.add_argument(
        "--tokenizer_dir",
        default=None,
        help="HF tokenizer directory (required with --engine_dir; overrides the profile's)",
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
    parser.add_argument(
        "--kv_cache_free_gpu_mem_fraction",
        type=float,
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
        type=int,
        default=None,
        help=f"pre/post-processing model instances (default: the profile's with --config, else "
        f"{defaults.instance_count})",
    )
    parser.add_argument("--chat_template_kwargs", default=None, help=CHAT_TEMPLATE_KWARGS_HELP)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an --output_dir an earlier dflash-trt triton wrote"
    )
    parser.add_argument("--json", action="store_true", help="print the repository settings as JSON")
    parser.set_defaults(func=run)


def _tokenizer_dir(path: str) -> Path:
    directory = Path(path)
    if not ((directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file()):
        raise DFlashTrtError(f"{directory} holds no tokenizer (tokenizer.json or tokenizer_config.json)")
    return directory


def _serving(args: argparse.Namespace, base: ServingSettings) -> ServingSettings:
    """`base` with the serving flags the user typed, checked by the build profile schema."""
    names = ("kv_cache_free_gpu_mem_fraction", "batch_scheduler_policy", "instance_count")
    return override_serving(base, {name: getattr(args, name) for name in names if getattr(args, name) is not None})


def run(args: argparse.Namespace) -> int:
    from dflash_trt.triton.repository import settings_from_engine, write_repository

    chat_kwargs = json.dumps(parse_chat_template_kwargs(args.chat_template_kwargs) or {})

    if args.engine_dir:
        if args.tokenizer_dir is None:
            raise DFlashTrtError("--tokenizer_dir is required with --engine_dir")
        settings = settings_from_engine(
            args.engine_dir, _tokenizer_dir(args.tokenizer_dir), _serving(args, ServingSettings())
        )
    else:
        from dflash_trt.pipeline import settings_from_profile, workspace
        from dflash_trt.profiles import load_profile, resolve_model_dir
        from dflash_trt.trtllm.plugin import default_library_path

        profile = load_profile(args.config)
        if args.tokenizer_dir:
            tokenizer = _tokenizer_dir(args.tokenizer_dir)
        else:
            cache = Path(args.hf_cache) if args.hf_cache else None
            model_dir = resolve_model_dir(profile.model.tokenizer_source, cache_dir=cache, allow_download=args.download)
            tokenizer = _tokenizer_dir(str(model_dir))
        library = args.plugin_library or default_library_path()
        settings = settings_from_profile(
            profile, workspace(profile, args.work_dir).engine, tokenizer, library, _serving(args, profile.serving)
        )
    settings = replace(settings, chat_template_kwargs=chat_kwargs)
    path = write_repository(settings, args.output_dir, overwrite=args.overwrite, inputs={"--config": args.config})
    if args.json:
        print(strict_json({"repository": str(path), **asdict(settings)}, indent=2))
    else:
        print(f"Triton repository written to {path}")
        print(f"start it with: {path / 'launch_triton.sh'}")
        print(f"then:          python {path / 'client.py'} --prompt 'Hello'")
    return 0
