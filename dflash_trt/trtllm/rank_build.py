"""Build one TP rank of a DFlash engine: `trtllm-build`'s own `main()`, restricted to that rank, in this process.

`trtllm-build --workers N` builds ranks in a spawned process pool and pickles the model class to it; our class is
loaded from `--model_cls_file` under the module name `models`, which a spawned worker cannot import, so only
`--workers 1` (rank after rank) works. Instead, one process per rank runs this module: `main()` parses the very
same `trtllm-build` arguments, loads the class file itself (no pickling) and calls `parallel_build`, which is
replaced here by a build of this process's rank only (`build_and_save`, as trtllm-build's serial path calls it).
Read in the TensorRT-LLM 1.2.x sources (tensorrt_llm/commands/build.py), not yet run on a GPU host.

    python -m dflash_trt.trtllm.rank_build --rank R --gpus G -- <trtllm-build arguments>
"""

from __future__ import annotations

import argparse
import sys

TRTLLM_BUILD = "trtllm-build"


def build_rank(rank: int, gpu: int, trtllm_build_args: list[str]) -> None:
    from tensorrt_llm.commands import build as trtllm_build

    def only_this_rank(model_config, ckpt_dir, build_config, output_dir, workers, log_level, model_cls, **kwargs):
        trtllm_build.build_and_save(
            rank, gpu, ckpt_dir, build_config, output_dir, log_level, model_config, model_cls, **kwargs
        )

    trtllm_build.parallel_build = only_this_rank
    sys.argv = [TRTLLM_BUILD, *trtllm_build_args]
    trtllm_build.main()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True, help="the TP rank this process builds")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs the ranks share: this rank uses rank %% gpus")
    parser.add_argument("trtllm_build_args", nargs=argparse.REMAINDER, help="after `--`: trtllm-build's arguments")
    args = parser.parse_args(argv)
    rest = args.trtllm_build_args[1:] if args.trtllm_build_args[:1] == ["--"] else args.trtllm_build_args
    build_rank(args.rank, args.rank % args.gpus, rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
