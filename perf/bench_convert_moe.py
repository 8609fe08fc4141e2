"""Mixture-of-experts conversion: memory and throughput on a synthetic Qwen3-MoE checkpoint, next to a plain copy.

Builds a random-bf16 target with Qwen3-Coder-30B-A3B's layer shapes (hidden 2048, 32 q / 4 kv heads of 128, 128
experts of moe_intermediate 768, top-8, every layer sparse; vocabulary cut to 32768 so the experts dominate) with
enough layers for ≥ 1 GiB (one layer of experts alone is 1.13 GiB, most of the checkpoint), two shards + index, and
a one-layer drafter. Each contender runs in its own child process, in rounds (the driver of perf/bench_convert.py:
peak RSS is the child's VmHWM, RssAnon / RssFile sampled every 10 ms; each round's speed ratio is the copy's end-to-end
time over the contender's, summarized as median and spread with the load average of every run):

- baseline: `dflash-trt convert` of a tiny MoE pair (interpreter + converter code + torch, which the cast of the
  bf16 router to float32 imports; no real data);
- convert at tp 1, and at tp 4 with `--moe_ep_size 2` (two expert groups, each expert split in two);
- copy: `cp -r` of both model folders, then `sync`.

A converter that stacked a whole layer of experts before writing would need more than a layer (1.13 GiB) above the
baseline; streaming expert by expert keeps it near one expert.

    python perf/bench_convert_moe.py [--layers N] [--repeats N] [--keep DIR]

Protocol of perf/bench_all.py: the last stdout line is one JSON object with the ratios.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
from bench_convert import (
    _gib,
    _write_random,
    child_contender,
    convert_argv,
    copy_once,
    directory_bytes,
    fraction,
    remove,
    report,
    rounded,
    run_in_work_dir,
    run_rounds,
    speed_ratios,
    summarize,
)
from transformers import Qwen3Config, Qwen3MoeConfig

from dflash_trt.spec import QWEN3_MOE, draft_tensor_shapes, load_draft_spec, load_target_spec, target_tensor_shapes

CODER_LAYER = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=32768,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


def build_moe_pair(root: Path, dims: dict, layers: int) -> tuple[Path, Path, int]:
    """A random bf16 Qwen3-MoE target (2 shards + index) and a one-layer drafter; their dirs and weight bytes."""
    target_dir, draft_dir = root / "target", root / "draft"
    target_dir.mkdir(parents=True)
    draft_dir.mkdir()
    target_cfg = Qwen3MoeConfig(
        **dims,
        num_hidden_layers=layers,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        max_position_embeddings=40960,
        eos_token_id=1,
    )
    target_cfg.architectures = [QWEN3_MOE]
    target_cfg.save_pretrained(target_dir)
    draft_cfg = Qwen3Config(
        **{k: v for k, v in dims.items() if k not in MOE_KEYS}, num_hidden_layers=1, max_position_embeddings=40960
    )
    draft_cfg.architectures = ["DFlashDraftModel"]
    draft_cfg.num_target_layers = layers
    draft_cfg.block_size = 16
    draft_cfg.dflash_config = {"mask_token_id": dims["vocab_size"] - 1, "target_layer_ids": [0, layers - 1]}
    draft_cfg.save_pretrained(draft_dir)

    target = load_target_spec(target_dir)
    generator = torch.Generator().manual_seed(0)
    shapes = target_tensor_shapes(target)
    names = list(shapes)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    total, weight_map = 0, {}
    for file_name, members in shards.items():
        total += _write_random(target_dir / file_name, {n: shapes[n] for n in members}, generator)
        weight_map |= dict.fromkeys(members, file_name)
    (target_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    draft = load_draft_spec(draft_dir, target)
    total += _write_random(draft_dir / "model.safetensors", draft_tensor_shapes(draft), generator)
    return target_dir, draft_dir, total


def main(argv: list[str] | None = None) -> int:
    return run_in_work_dir(_run, argv, __doc__, 1, "target layers (1 gives a 1.4 GiB pair)")


def _run(root: Path, layers: int, repeats: int) -> int:
    started = time.perf_counter()
    tiny_target, tiny_draft, _ = build_moe_pair(root / "tiny", TINY, 2)
    target_dir, draft_dir, size = build_moe_pair(root / "big", CODER_LAYER, layers)
    print(f"synthetic MoE checkpoint: {_gib(size)} in {time.perf_counter() - started:.1f} s", flush=True)
    tiny_out = root / "tiny_out"
    written: dict[str, int] = {}
    contenders = {
        "baseline": child_contender(
            "convert", {"argv": convert_argv(tiny_target, tiny_draft, tiny_out, 1)}, remove(tiny_out)
        ),
        "copy": lambda: copy_once([target_dir, draft_dir], root / "copy"),
    }
    for name, tp, ep in (("tp1", 1, 1), ("tp4_ep2", 4, 2)):
        out = root / name

        def cleanup(out: Path = out, name: str = name) -> None:
            written[name] = directory_bytes(out)
            shutil.rmtree(out)

        argv = convert_argv(target_dir, draft_dir, out, tp, "--moe_ep_size", str(ep))
        contenders[name] = child_contender("convert", {"argv": argv}, cleanup)
    runs = run_rounds(contenders, repeats)
    results = summarize(runs)
    report(results, size)
    speeds = {name: speed_ratios(runs, name) for name in ("tp1", "tp4_ep2")}
    for name, ratio in speeds.items():
        print(f"{name} vs cp -r + sync: {ratio['median']:.3f} x (rounds {ratio['min']:.3f}-{ratio['max']:.3f})")

    ratios = {
        "moe_convert_tp1_rss_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp1", "rss_above_baseline"),
        "moe_convert_tp4_ep2_rss_above_baseline_vs_checkpoint_bytes": fraction(
            results, size, "tp4_ep2", "rss_above_baseline"
        ),
        "moe_convert_tp1_anon_above_baseline_vs_checkpoint_bytes": fraction(
            results, size, "tp1", "anon_above_baseline"
        ),
        "moe_convert_tp1_throughput_vs_copy": round(speeds["tp1"]["median"], 4),
        "moe_convert_tp4_ep2_throughput_vs_copy": round(speeds["tp4_ep2"]["median"], 4),
    }
    details = {
        "checkpoint_bytes": size,
        "target_layers": layers,
        "rounds": repeats,
        "cpu_threads": torch.get_num_threads(),
        "bytes_written": written,
        "throughput_vs_copy": rounded(speeds),
        **rounded(results),
    }
    print(json.dumps({"name": "convert_moe", "ratios": ratios, "details": details}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
