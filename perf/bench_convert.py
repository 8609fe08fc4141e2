"""Converter memory and throughput on a synthetic ≥ 2 GB checkpoint, next to a plain copy and a naive converter.

Builds a random-bf16 Qwen3-4B-shaped target (hidden 2560, 32 q / 8 kv heads of 128, intermediate 9728, vocab
151936, untied lm_head, layers cut so the pair is ≥ 2 GB, two shards + index) and a one-layer DFlash drafter, then
runs each contender in its own child process, whose peak RSS comes from the OS (its VmHWM in /proc):

- baseline: `dflash-trt convert` of a tiny pair (interpreter + torch + the converter's code, no real data);
- convert at tp 1 and tp 8 (`dflash-trt convert`, in the same child driver as the baseline);
- plain copy: `shutil.copyfile` of every input file, each fsynced (the converter fsyncs its rank files too);
- naive: `safetensors.torch.load_file` of every input, fuse q|k|v, rename, one `save_file` (what loading the whole
  model first costs).

Each child also samples its RssAnon / RssFile every 10 ms, which tells memory the process allocated apart from
pages of memory-mapped files it has touched. Times are of the work inside the child (interpreter start excluded),
with the inputs in the page cache for every contender. Throughput is checkpoint bytes processed per second.

    python perf/bench_convert.py [--layers N] [--repeats N] [--keep DIR]

Protocol of perf/bench_all.py: the last stdout line is one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Qwen3Config

from dflash_trt.checkpoint.safetensors_io import StreamingSafetensorsWriter
from dflash_trt.spec import draft_tensor_shapes, load_draft_spec, load_target_spec, target_tensor_shapes

REPO_ROOT = Path(__file__).resolve().parents[1]
QWEN3_4B = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256
)

# Runs in each child: samples /proc/self/status while doing one job, then prints the job's time and peaks.
CHILD = r"""
import json, os, sys, threading, time

peaks = {"RssAnon": 0, "RssFile": 0}
done = threading.Event()

def sample():
    while not done.is_set():
        with open("/proc/self/status") as status:
            for line in status:
                key = line.split(":")[0]
                if key in peaks:
                    peaks[key] = max(peaks[key], int(line.split()[1]) * 1024)
        done.wait(0.01)

job, args = sys.argv[1], json.loads(sys.argv[2])
if job == "convert":
    from dflash_trt.cli import build_parser, main
    build_parser()  # imports every subcommand's module, so the timed part is the conversion alone
elif job == "naive":
    import torch
    from safetensors.torch import load_file, save_file
elif job == "copy":
    import shutil
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
if job == "convert":
    code = main(args["argv"])
    assert code == 0, code
elif job == "copy":
    for source in args["files"]:
        target = os.path.join(args["out"], os.path.basename(source))
        shutil.copyfile(source, target)
        with open(target, "rb+") as handle:
            os.fsync(handle.fileno())
elif job == "naive":
    tensors = {}
    for source in args["files"]:
        tensors.update(load_file(source))
    out = {}
    for layer in range(args["layers"]):
        prefix = f"model.layers.{layer}.self_attn."
        out[f"layer{layer}.qkv"] = torch.cat([tensors.pop(prefix + p + "_proj.weight") for p in "qkv"])
    out.update(tensors)
    save_file(out, args["out"])
    with open(args["out"], "rb+") as handle:
        os.fsync(handle.fileno())
seconds = time.perf_counter() - started
done.set()
with open("/proc/self/status") as status:
    hwm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_rss": hwm, **peaks}))
"""


def _write_random(path: Path, shapes: dict[str, tuple[int, ...]], generator: torch.Generator) -> int:
    entries = {name: (torch.bfloat16, shape) for name, shape in shapes.items()}
    with StreamingSafetensorsWriter(path, entries, metadata={"format": "pt"}) as writer:
        for name, shape in shapes.items():
            writer.write(name, torch.randn(shape, generator=generator, dtype=torch.bfloat16))
    return path.stat().st_size


def build_pair(root: Path, dims: dict, layers: int, draft_layers: int = 1) -> tuple[Path, Path, int]:
    """A random bf16 Qwen3 target (2 shards + index) and DFlash drafter; returns their dirs and total weight bytes."""
    target_dir, draft_dir = root / "target", root / "draft"
    target_dir.mkdir(parents=True)
    draft_dir.mkdir()
    target_cfg = Qwen3Config(
        **dims,
        num_hidden_layers=layers,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        max_position_embeddings=40960,
        eos_token_id=1,
    )
    target_cfg.architectures = ["Qwen3ForCausalLM"]
    target_cfg.save_pretrained(target_dir)
    draft_cfg = Qwen3Config(**dims, num_hidden_layers=draft_layers, max_position_embeddings=40960)
    draft_cfg.architectures = ["DFlashDraftModel"]
    draft_cfg.num_target_layers = layers
    draft_cfg.block_size = 16
    draft_cfg.dflash_config = {
        "mask_token_id": dims["vocab_size"] - 1,
        "target_layer_ids": sorted({0, layers // 2, layers - 1}),
    }
    draft_cfg.save_pretrained(draft_dir)

    target = load_target_spec(target_dir)
    generator = torch.Generator().manual_seed(0)
    shapes = target_tensor_shapes(target)
    names = list(shapes)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    total = 0
    weight_map = {}
    for file_name, members in shards.items():
        total += _write_random(target_dir / file_name, {n: shapes[n] for n in members}, generator)
        weight_map |= dict.fromkeys(members, file_name)
    (target_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    draft = load_draft_spec(draft_dir, target)
    total += _write_random(draft_dir / "model.safetensors", draft_tensor_shapes(draft), generator)
    return target_dir, draft_dir, total


def weight_files(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs for p in sorted(d.glob("*.safetensors"))]


def measure(job: str, args: dict, repeats: int, cleanup: Callable[[], None]) -> dict:
    """Best time and highest peaks of `repeats` runs of one job, each in a fresh interpreter after a sync.

    The peak RSS is the child's VmHWM, read by the child itself just before it exits: the high-water mark of its own
    address space since exec. (`ru_maxrss` of a child is no use here: Linux carries the parent's high-water mark
    over the fork + exec, so every child would report at least this process's size.)
    """
    best: dict = {}
    for _ in range(repeats):
        os.sync()  # no dirty pages of an earlier step may be flushed on this job's time
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, job, json.dumps(args)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{job} child failed ({proc.returncode}): {proc.stderr[-2000:]}")
        result = json.loads(proc.stdout.splitlines()[-1])
        cleanup()
        best = {key: (min if key == "seconds" else max)(value, best.get(key, value)) for key, value in result.items()}
    return best


def convert_argv(target_dir: Path, draft_dir: Path, out: Path, tp: int, *extra: str) -> list[str]:
    """`dflash-trt convert` of a bf16 checkpoint at tensor-parallel size `tp` (plus any `extra` flags)."""
    return [
        "convert",
        "--model_dir",
        str(target_dir),
        "--dflash_model_dir",
        str(draft_dir),
        "--output_dir",
        str(out),
        "--tp_size",
        str(tp),
        *extra,
        "--dtype",
        "bfloat16",
    ]


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def run_in_work_dir(
    run: Callable[[Path, int, int], int], argv: list[str] | None, doc: str | None, layers: int, layers_help: str
) -> int:
    """The command line both conversion benchmarks share: --layers, --repeats, --keep (else a temp dir)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=layers, help=layers_help)
    parser.add_argument("--repeats", type=int, default=2, help="runs per contender; best time, highest peaks")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return run(root, args.layers, args.repeats)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


def measure_copy(root: Path, inputs: list[str], repeats: int) -> dict:
    """The plain-copy contender: every input file copied and fsynced into a fresh folder."""
    copy_dir = root / "copy"

    def fresh_copy_dir() -> None:
        shutil.rmtree(copy_dir, ignore_errors=True)
        copy_dir.mkdir()

    fresh_copy_dir()
    return measure("copy", {"files": inputs, "out": str(copy_dir)}, repeats, fresh_copy_dir)


def remove(path: Path) -> Callable[[], None]:
    """A contender's cleanup: delete what it wrote (a folder or a file)."""
    return lambda: shutil.rmtree(path) if path.is_dir() else path.unlink()


def measure_baseline(root: Path, tiny_target: Path, tiny_draft: Path, repeats: int) -> dict:
    """The baseline contender: `dflash-trt convert` of a tiny pair (interpreter + torch + converter, no real data)."""
    tiny_out = root / "tiny_out"
    return measure("convert", {"argv": convert_argv(tiny_target, tiny_draft, tiny_out, 1)}, repeats, remove(tiny_out))


def fraction(results: dict[str, dict], size: int, name: str, key: str) -> float:
    """A contender's `key` (bytes) as a share of the checkpoint."""
    return round(results[name][key] / size, 4)


def speed(results: dict[str, dict], name: str) -> float:
    """A contender's throughput against the plain copy's."""
    return round(results["copy"]["seconds"] / results[name]["seconds"], 4)


def rounded(results: dict[str, dict]) -> dict[str, dict]:
    """Every contender's result with floats rounded for the JSON line."""
    return {name: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for name, r in results.items()}


def report(results: dict[str, dict], size: int) -> None:
    """Adds the above-baseline peaks and the rate to each contender's result, and prints one line each."""
    base = results["baseline"]
    for name, r in results.items():
        r["rss_above_baseline"] = r["peak_rss"] - base["peak_rss"]
        r["anon_above_baseline"] = r["RssAnon"] - base["RssAnon"]
        if name != "baseline":  # the baseline converts a tiny pair, not the checkpoint
            r["gb_per_s"] = size / r["seconds"] / 1e9
        rate = f"{r['gb_per_s']:5.2f} GB/s" if "gb_per_s" in r else "       -  "
        print(
            f"{name:9s} {r['seconds']:7.2f} s  {rate}  peak RSS {_gib(r['peak_rss'])} "
            f"(+{_gib(r['rss_above_baseline'])} over baseline; peak anon {_gib(r['RssAnon'])}, "
            f"peak file-mapped {_gib(r['RssFile'])})",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    return run_in_work_dir(_run, argv, __doc__, 2, "target layers (2 gives a 2.2 GB pair)")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _run(root: Path, layers: int, repeats: int) -> int:
    started = time.perf_counter()
    tiny_target, tiny_draft, _ = build_pair(root / "tiny", TINY, 2)
    target_dir, draft_dir, size = build_pair(root / "big", QWEN3_4B, layers)
    print(f"synthetic checkpoint: {_gib(size)} in {time.perf_counter() - started:.1f} s", flush=True)
    inputs = weight_files(target_dir, draft_dir)
    results = {"baseline": measure_baseline(root, tiny_target, tiny_draft, repeats)}
    written = {}
    for tp in (1, 8):
        out = root / f"tp{tp}"

        def cleanup(out: Path = out, tp: int = tp) -> None:
            written[tp] = directory_bytes(out)
            shutil.rmtree(out)

        results[f"tp{tp}"] = measure(
            "convert", {"argv": convert_argv(target_dir, draft_dir, out, tp)}, repeats, cleanup
        )
    results["copy"] = measure_copy(root, inputs, repeats)
    naive_out = root / "naive.safetensors"
    results["naive"] = measure(
        "naive", {"files": inputs, "out": str(naive_out), "layers": layers}, repeats, remove(naive_out)
    )

    report(results, size)

    ratios = {
        "convert_tp1_rss_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp1", "rss_above_baseline"),
        "convert_tp8_rss_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp8", "rss_above_baseline"),
        "naive_rss_above_baseline_vs_checkpoint_bytes": fraction(results, size, "naive", "rss_above_baseline"),
        "convert_tp1_anon_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp1", "anon_above_baseline"),
        "convert_tp8_anon_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp8", "anon_above_baseline"),
        "convert_tp1_throughput_vs_copy": speed(results, "tp1"),
        "convert_tp8_throughput_vs_copy": speed(results, "tp8"),
        # tp 8 writes the replicated embedding and norms 8 times: its write rate against the copy's.
        "convert_tp8_bytes_written_per_s_vs_copy": round(
            written[8] / results["tp8"]["seconds"] / (size / results["copy"]["seconds"]), 4
        ),
        "naive_throughput_vs_copy": speed(results, "naive"),
    }
    details = {
        "checkpoint_bytes": size,
        "target_layers": layers,
        "repeats": repeats,
        "cpu_threads": torch.get_num_threads(),
        "tp1_bytes_written": written[1],
        "tp8_bytes_written": written[8],
        **rounded(results),
    }
    print(json.dumps({"name": "convert", "ratios": ratios, "details": details}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
