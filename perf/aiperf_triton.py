"""External cross-check of bench's Triton text path: aiperf and `dflash-trt bench` against the same ensemble.

A real tritonserver (`make tritonserver`) serves the CPU-served repository of the tiny pair (`dflash-trt triton
--checkpoint_dir`, max_batch_size 4). Both load generators drive the `ensemble` model over HTTP `generate_stream`
with the same held-out prompts, greedy, the same output budget, in a closed loop at each concurrency: aiperf 0.13
through its template endpoint (a Jinja payload, `response_field: text_output`, tokens counted by re-tokenizing
the text with the pair's tokenizer) and bench through `--triton_protocol http` (tokens counted the same way).
Each point is measured `--rounds` times, aiperf and bench alternating, and the medians are compared (on a shared
machine one run of either moves by tens of percent with the other load); the ratio bench / aiperf of the median
output tokens/s must lie within 1 ± 0.15 at each concurrency.

aiperf is not a project dependency (about 1.2 GB installed): install it into a venv of its own and name its binary,
    python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
    .venv/bin/python perf/aiperf_triton.py --aiperf /tmp/aiperf-venv/bin/aiperf --output_dir /tmp/aiperf-triton
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.triton.repository import LAUNCH_SCRIPT, settings_from_checkpoint, write_repository

ROOT = Path(__file__).resolve().parents[1]
MODEL = "ensemble"
MAX_NEW = 32
PROMPTS = 8
MAX_SEQ_LEN = 224
TOLERANCE = 0.15
# aiperf's Jinja request body: the ensemble's inputs, greedy, the same budget as bench's --max_new_tokens.
PAYLOAD = '{"text_input": {{ text|tojson }}, "max_tokens": ' + str(MAX_NEW) + ', "stream": true, "temperature": 0.0}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repo: Path, log: Path, tritonserver: Path) -> tuple[subprocess.Popen, int]:
    http, grpc = _free_port(), _free_port()
    args = [
        str(repo / LAUNCH_SCRIPT),
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        "--allow-metrics=false",
        "--exit-timeout-secs=5",
    ]
    env = {**os.environ, "TRITONSERVER": str(tritonserver)}
    with open(log, "ab") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    for _ in range(480):
        if process.poll() is not None:
            sys.exit(f"tritonserver exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return process, http
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(process)
    sys.exit(f"tritonserver not ready; see {log}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # python stubs outlive a killed server
    except ProcessLookupError:
        pass
    process.wait()


def cpu_seconds_of(command: list[str], **kwargs) -> float:
    """Run `command` to completion; the CPU seconds it and its descendants used (the load generator's own cost,
    taken from the cores the server shares)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, check=True, **kwargs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def run_aiperf(
    aiperf: str, port: int, tokenizer: Path, prompts: Path, concurrency: int, requests: int, out: Path
) -> tuple[float, float]:
    template = out / "payload.json.j2"
    template.write_text(PAYLOAD)
    artifacts = out / f"aiperf_c{concurrency}_{len(list(out.glob(f'aiperf_c{concurrency}_*/')))}"
    command = [
        aiperf, "profile",
        "--model", MODEL,
        "--tokenizer", str(tokenizer),
        "--url", f"http://127.0.0.1:{port}",
        "--endpoint-type", "template",
        "--custom-endpoint", f"/v2/models/{MODEL}/generate_stream",
        "--streaming",
        "--extra-inputs", f"payload_template:{template}",
        "--extra-inputs", "response_field:text_output",
        "--input-file", str(prompts),
        "--custom-dataset-type", "single_turn",
        "--dataset-sampling-strategy", "sequential",
        "--concurrency", str(concurrency),
        "--request-count", str(requests),
        "--warmup-request-count", str(concurrency),
        "--random-seed", "123",
        "--artifact-dir", str(artifacts),
    ]  # fmt: skip
    with open(artifacts.with_suffix(".log"), "wb") as log:
        cpu_s = cpu_seconds_of(command, stdout=log, stderr=subprocess.STDOUT)
    export = json.loads((artifacts / "profile_export_aiperf.json").read_text())  # the profiling phase's
    return export["output_token_throughput"]["avg"], cpu_s


def run_bench(
    port: int, tokenizer: Path, prompts: Path, concurrency: int, requests: int, out: Path
) -> tuple[float, float]:
    results = out / f"bench_c{concurrency}_{len(list(out.glob(f'bench_c{concurrency}_*/')))}"
    command = [
        sys.executable, "-m", "dflash_trt.cli", "bench",
        "--triton_url", f"127.0.0.1:{port}",
        "--triton_protocol", "http",
        "--triton_model", MODEL,
        "--tokenizer_dir", str(tokenizer),
        "--input_file", str(prompts),
        "--max_new_tokens", str(MAX_NEW),
        "--num_requests", str(requests),
        "--warmup", str(concurrency),
        "--concurrency", str(concurrency),
        "--output_dir", str(results),
        "--overwrite",
    ]  # fmt: skip
    cpu_s = cpu_seconds_of(command, stdout=subprocess.DEVNULL)
    [point] = json.loads((results / "results.json").read_text())["points"]
    return point["throughput_tok_s"], cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", required=True, help="the aiperf binary (installed outside this environment)")
    parser.add_argument("--output_dir", required=True, type=Path)
    parser.add_argument("--tritonserver", type=Path, default=ROOT / ".tritonserver" / "tritonserver")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", type=int, default=96, help="measured requests per point and load generator")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each load generator per point")
    args = parser.parse_args()
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=False)
    checkpoint = out / "ckpt"
    convert_checkpoint(target_dir(), draft_dir(), checkpoint, dtype="float32")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": item.text}) + "\n" for item in load_heldout(limit=PROMPTS)))
    settings = settings_from_checkpoint(checkpoint, checkpoint, max_batch_size=4, max_seq_len=MAX_SEQ_LEN)
    repo = write_repository(settings, out / "repo")
    process, port = start_server(repo, out / "server.log", args.tritonserver)
    rows = []
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            load_before = os.getloadavg()[0]
            aiperf, bench = [], []
            for _ in range(args.rounds):
                aiperf.append(run_aiperf(args.aiperf, port, checkpoint, prompts, concurrency, args.requests, out))
                bench.append(run_bench(port, checkpoint, prompts, concurrency, args.requests, out))
            rows.append({
                "concurrency": concurrency,
                "aiperf_tok_s": [tok_s for tok_s, _ in aiperf],
                "bench_tok_s": [tok_s for tok_s, _ in bench],
                "aiperf_cpu_s": [cpu_s for _, cpu_s in aiperf],
                "bench_cpu_s": [cpu_s for _, cpu_s in bench],
                "bench_vs_aiperf": statistics.median(t for t, _ in bench) / statistics.median(t for t, _ in aiperf),
                "load_avg_1min": [load_before, os.getloadavg()[0]],
            })  # fmt: skip
    finally:
        stop_server(process)
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| concurrency | aiperf output tok/s (runs) | bench output tok/s (runs) | bench / aiperf (medians) | load |")
    print("|---|---|---|---|---|")
    for r in rows:
        runs = {name: ", ".join(f"{x:.0f}" for x in r[f"{name}_tok_s"]) for name in ("aiperf", "bench")}
        load = " → ".join(f"{x:.1f}" for x in r["load_avg_1min"])
        print(f"| {r['concurrency']} | {runs['aiperf']} | {runs['bench']} | {r['bench_vs_aiperf']:.3f} | {load} |")
    for r in rows:
        cpu = {name: ", ".join(f"{x:.1f}" for x in r[f"{name}_cpu_s"]) for name in ("aiperf", "bench")}
        print(f"c={r['concurrency']}: CPU seconds per run, aiperf {cpu['aiperf']}; bench {cpu['bench']}")
    off = [r for r in rows if abs(r["bench_vs_aiperf"] - 1) > TOLERANCE]
    sys.exit(1 if off else 0)


if __name__ == "__main__":
    main()
