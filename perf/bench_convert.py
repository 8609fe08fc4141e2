"""Converter memory and throughput on a synthetic ≥ 2 GB checkpoint, next to `cp -r` + `sync` and a naive converter.

Builds a random-bf16 Qwen3-4B-shaped target (hidden 2560, 32 q / 8 kv heads of 128, intermediate 9728, vocab
151936, untied lm_head, layers cut so the pair is ≥ 2 GB, two shards + index) and a one-layer DFlash drafter, then
runs each contender in its own child process, whose peak RSS comes from the OS (its VmHWM in /proc):

- baseline: `dflash-trt convert` of a tiny pair (interpreter + the converter's code, no real data; an unquantized
  conversion does not import torch);
- convert at tp 1 and tp 8 (`dflash-trt convert`, in the same child driver as the baseline);
- copy: `cp -r` of both model folders, then `sync` (what a user compares a conversion with);
- naive: `safetensors.torch.load_file` of every input, fuse q|k|v, rename, one `save_file` (what loading the whole
  model first costs).

The contenders run in rounds, one run of each per round, so every ratio compares runs taken moments apart (the
machine may be shared: its load changes from minute to minute). Each round's speed ratio is the copy's time over the
contender's, both end to end (a fresh process, start-up included, as a user times them); the summary gives the
median and spread (min-max) over the rounds with the load average (`uptime`) each run started at. Each convert child
also samples its RssAnon / RssFile every 10 ms, which tells memory the process allocated apart from pages of
memory-mapped files it has touched, and reports the time of its work alone (interpreter start excluded). Inputs are
in the page cache for every contender.

    python perf/bench_convert.py [--layers N] [--repeats N] [--keep DIR]

Protocol of perf/bench_all.py: the last stdout line is one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
if job == "convert":
    code = main(args["argv"])
    assert code == 0, code
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


def run_child(job: str, args: dict) -> dict:
    """One run of a job in a fresh interpreter after a sync: the child's own figures, its end-to-end time and the
    load average it started at.

    The peak RSS is the child's VmHWM, read by the child itself just before it exits: the high-water mark of its own
    address space since exec. (`ru_maxrss` of a child is no use here: Linux carries the parent's high-water mark
    over the fork + exec, so every child would report at least this process's size.)
    """
    os.sync()  # no dirty pages of an earlier step may be flushed on this job's time
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, job, json.dumps(args)], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{job} child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {**json.loads(proc.stdout.splitlines()[-1]), "wall_seconds": wall, "load": load}


def copy_once(sources: list[Path], out: Path) -> dict:
    """`cp -r` of the model folders into a fresh folder, then `sync`, timed as one command line."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    os.sync()
    load = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run(["cp", "-r", *map(str, sources), str(out)], check=True)
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - started
    shutil.rmtree(out)
    return {"wall_seconds": wall, "load": load}


Contender = Callable[[], dict]


def child_contender(job: str, args: dict, cleanup: Callable[[], None]) -> Contender:
    def once() -> dict:
        result = run_child(job, args)
        cleanup()
        return result

    return once


def run_rounds(contenders: dict[str, Contender], repeats: int) -> dict[str, list[dict]]:
    """`repeats` rounds of one run of every contender, in order; each contender's runs, round by round."""
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for round_number in range(repeats):
        for name, once in contenders.items():
            runs[name].append(once())
            print(f"round {round_number + 1}: {name} {runs[name][-1]['wall_seconds']:.2f} s", flush=True)
    return runs


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender: end-to-end and work times (median, spread), the highest peaks, and every run's load."""
    results = {}
    for name, rounds in runs.items():
        result: dict = {"wall_seconds": spread([r["wall_seconds"] for r in rounds])}
        if "seconds" in rounds[0]:
            result["seconds"] = spread([r["seconds"] for r in rounds])
        for key in ("peak_rss", "RssAnon", "RssFile"):
            if key in rounds[0]:
                result[key] = max(r[key] for r in rounds)
        result["loads"] = [round(r["load"], 2) for r in rounds]
        results[name] = result
    return results


def speed_ratios(runs: dict[str, list[dict]], name: str) -> dict[str, float]:
    """The copy's end-to-end time over the contender's, round by round: median and spread."""
    return spread([c["wall_seconds"] / r["wall_seconds"] for c, r in zip(runs["copy"], runs[name], strict=True)])


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
    parser.add_argument("--repeats", type=int, default=5, help="rounds (one run of every contender each)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.layers < 1:
        parser.error("--repeats and --layers must be >= 1")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return run(root, args.layers, args.repeats)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


def remove(path: Path) -> Callable[[], None]:
    """A contender's cleanup: delete what it wrote (a folder or a file)."""
    return lambda: shutil.rmtree(path) if path.is_dir() else path.unlink()


def fraction(results: dict[str, dict], size: int, name: str, key: str) -> float:
    """A contender's `key` (bytes) as a share of the checkpoint."""
    return round(results[name][key] / size, 4)


def rounded(value: Any) -> Any:
    """Floats rounded to 3 places, anywhere in a nested result."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def _span(times: dict[str, float]) -> str:
    return f"{times['median']:6.2f} s ({times['min']:.2f}-{times['max']:.2f})"


def report(results: dict[str, dict], size: int) -> None:
    """Adds the above-baseline peaks and the rate to each contender's result, and prints one line each."""
    base = results["baseline"]
    for name, r in results.items():
        if "peak_rss" in r:
            r["rss_above_baseline"] = r["peak_rss"] - base["peak_rss"]
            r["anon_above_baseline"] = r["RssAnon"] - base["RssAnon"]
        if name != "baseline":  # the baseline converts a tiny pair, not the checkpoint
            r["gb_per_s"] = size / r["wall_seconds"]["median"] / 1e9
        rate = f"{r['gb_per_s']:5.2f} GB/s" if "gb_per_s" in r else "       -  "
        work = f"  work {_span(r['seconds'])}" if "seconds" in r else ""
        memory = (
            f"  peak RSS {_gib(r['peak_rss'])} (+{_gib(r['rss_above_baseline'])} over baseline; "
            f"peak anon {_gib(r['RssAnon'])}, peak file-mapped {_gib(r['RssFile'])})"
            if "peak_rss" in r
            else ""
        )
        print(f"{name:9s} end to end {_span(r['wall_seconds'])}  {rate}{work}{memory}  load {r['loads']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    return run_in_work_dir(_run, argv, __doc__, 2, "target layers (2 gives a 2.2 GB pair)")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _run(root: Path, layers: int, repeats: int) -> int:
    started = time.perf_counter()
    tiny_target, tiny_draft, _ = build_pair(root / "tiny", TINY, 2)
    target_dir, draft_dir, size = build_pair(root / "big", QWEN3_4B, layers)
    print(f"synthetic checkpoint: {_gib(size)} in {time.perf_counter() - started:.1f} s", flush=True)
    tiny_out, naive_out = root / "tiny_out", root / "naive.safetensors"
    written: dict[int, int] = {}
    contenders = {
        "baseline": child_contender(
            "convert", {"argv": convert_argv(tiny_target, tiny_draft, tiny_out, 1)}, remove(tiny_out)
        ),
        "copy": lambda: copy_once([target_dir, draft_dir], root / "copy"),
    }
    for tp in (1, 8):
        out = root / f"tp{tp}"

        def cleanup(out: Path = out, tp: int = tp) -> None:
            written[tp] = directory_bytes(out)
            shutil.rmtree(out)

        contenders[f"tp{tp}"] = child_contender(
            "convert", {"argv": convert_argv(target_dir, draft_dir, out, tp)}, cleanup
        )
    naive_args = {"files": weight_files(target_dir, draft_dir), "out": str(naive_out), "layers": layers}
    contenders["naive"] = child_contender("naive", naive_args, remove(naive_out))
    runs = run_rounds(contenders, repeats)
    results = summarize(runs)
    report(results, size)
    speeds = {name: speed_ratios(runs, name) for name in ("tp1", "tp8", "naive")}
    # tp 8 writes the replicated embedding and norms 8 times: its write rate against the copy's.
    tp8_written = spread(
        [
            written[8] / size * c["wall_seconds"] / r["wall_seconds"]
            for c, r in zip(runs["copy"], runs["tp8"], strict=True)
        ]
    )
    for name, ratio in (*speeds.items(), ("tp8 bytes written", tp8_written)):
        print(f"{name} vs cp -r + sync: {ratio['median']:.3f} x (rounds {ratio['min']:.3f}-{ratio['max']:.3f})")

    ratios = {
        "convert_tp1_rss_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp1", "rss_above_baseline"),
        "convert_tp8_rss_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp8", "rss_above_baseline"),
        "naive_rss_above_baseline_vs_checkpoint_bytes": fraction(results, size, "naive", "rss_above_baseline"),
        "convert_tp1_anon_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp1", "anon_above_baseline"),
        "convert_tp8_anon_above_baseline_vs_checkpoint_bytes": fraction(results, size, "tp8", "anon_above_baseline"),
        "convert_tp1_throughput_vs_copy": round(speeds["tp1"]["median"], 4),
        "convert_tp8_throughput_vs_copy": round(speeds["tp8"]["median"], 4),
        "convert_tp8_bytes_written_per_s_vs_copy": round(tp8_written["median"], 4),
        "naive_throughput_vs_copy": round(speeds["naive"]["median"], 4),
    }
    details = {
        "checkpoint_bytes": size,
        "target_layers": layers,
        "rounds": repeats,
        "cpu_threads": torch.get_num_threads(),
        "tp1_bytes_written": written[1],
        "tp8_bytes_written": written[8],
        "throughput_vs_copy": rounded({**speeds, "tp8_bytes_written": tp8_written}),
        **rounded(results),
    }
    print(json.dumps({"name": "convert", "ratios": ratios, "details": details}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
