"""The OpenAI front's own cost (`dflash-trt serve`): what one server process sustains, and what it adds to TPOT.

An instant executor stands in for the GPU: every in-flight request gets 4 tokens per iteration (a DFlash step),
either as fast as the event loop allows (throughput) or one iteration every 13.3 ms (64 users at 300 tok/s/user,
TPOT 3.33 ms). The server runs in its own process (uvicorn, the app, the tiny pair's tokenizer detokenizing every
token); the load generator is `bench --openai_url`'s, in this process, over the OpenAI executor (HTTP streaming),
64 users in a closed loop. Two ratios (`make bench` protocol):

- `server_tok_s_per_cpu_s_vs_20000`: streamed output tokens per CPU-second of the server process, over 20,000
  (the details add the same at one token per response: plain autoregressive decoding's worst case).
  Per CPU-second so the load generator and other work on the machine (they share its cores) do not count
  against the server; wall-clock tokens/s are in the details. Above 1, one process streams 20k tok/s.
- `tpot_http_vs_direct`: the mean TPOT of 64 users through HTTP over the same paced executor driven directly by
  the load generator, measured the same way. At most 1.05: the front adds at most 5 % per output token.

Linux only (the server's CPU time is read from /proc).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
from pathlib import Path

from dflash_trt.bench.driver import run_load
from dflash_trt.bench.results import request_tpot
from dflash_trt.executors.contract import Executor, Request, Response

USERS = 64
TOKENS = [69, 70, 71, 72]  # "abcd" in the tiny pair's tokenizer: real text to detokenize
OUTPUT_TOKENS = 256
PACED_INTERVAL_S = len(TOKENS) / 300.0  # 300 tok/s per user
NEEDED_TOK_S = 20_000


class InstantExecutor(Executor):
    """Every in-flight request gets len(TOKENS) tokens per iteration; an iteration starts `interval_s` after the
    previous one (0: as soon as the event loop has sent the previous one's responses)."""

    def __init__(self, interval_s: float = 0.0, tokens: list[int] = TOKENS):
        self.interval_s = interval_s
        self.tokens = tokens
        self.left: dict[int, int] = {}
        self.scheduled = False

    async def start(self, deliver):
        self.deliver = deliver
        self.loop = asyncio.get_running_loop()

    def submit(self, request_id, request):
        self.left[request_id] = request.max_new_tokens
        self._schedule()

    def cancel(self, request_id):
        self.left.pop(request_id, None)

    def _schedule(self):
        if not self.scheduled:
            self.scheduled = True
            if self.interval_s:
                self.loop.call_later(self.interval_s, self._iteration)
            else:
                self.loop.call_soon(self._iteration)

    def _iteration(self):
        self.scheduled = False
        batch = []
        for request_id, left in list(self.left.items()):
            n = min(len(self.tokens), left)
            batch.append(Response(request_id=request_id, tokens=self.tokens[:n], final=n == left))
            if n == left:
                del self.left[request_id]
            else:
                self.left[request_id] = left - n
        self.deliver(batch)
        if self.left:
            self._schedule()

    async def stop(self):
        pass


def serve(sock, interval_s: float, tokens: list[int]) -> None:
    """The server process: the real app over the instant executor (tiny pair tokenizer), until terminated."""
    from dflash_trt.server.launch import make_app, uvicorn_server
    from dflash_trt.server.params import Limits
    from dflash_trt.server.targets import ServeTarget
    from dflash_trt.tiny.heldout import target_dir
    from dflash_trt.tokenizer import load_tokenizer

    target = ServeTarget(
        executor=InstantExecutor(interval_s, tokens),
        max_batch_size=USERS,
        limits=Limits(max_seq_len=4096, vocab_size=128),
        eos_token_ids=frozenset(),
        engine_stops_at_eos=True,
    )
    app = make_app(target, load_tokenizer(target_dir()), "instant")
    uvicorn_server(app).run(sockets=[sock])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests(count: int) -> list[Request]:
    return [Request(input_ids=[5, 6, 7, 8], max_new_tokens=OUTPUT_TOKENS) for _ in range(count)]


def mean_tpot(executor: Executor, count: int) -> tuple[float, float, int]:
    """Mean TPOT, wall seconds and output tokens of `count` requests at USERS concurrency."""
    trace = asyncio.run(run_load(executor, requests(count), concurrency=USERS, timeout_s=600))
    failed = [r.error for r in trace.records if r.error]
    assert not failed, failed[:3]
    tpots = [t for t in map(request_tpot, trace.records) if t is not None]
    tokens = sum(len(r.output_ids) for r in trace.records)
    assert tokens == count * OUTPUT_TOKENS
    return statistics.fmean(tpots), trace.duration_s, tokens


def through_http(interval_s: float, count: int, tokens: list[int] = TOKENS) -> tuple[float, float, int, float]:
    """Mean TPOT, wall seconds, tokens and server CPU-seconds of a run through a fresh server process."""
    from dflash_trt.clients.openai_http import OpenAIExecutor
    from dflash_trt.server.launch import listen

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(sock, interval_s, tokens), daemon=True)
    server.start()

    def client() -> Executor:
        return OpenAIExecutor(f"http://127.0.0.1:{port}/v1")

    try:
        asyncio.run(mean_tpot_warm(client(), USERS))  # warm-up: imports, connections, first requests
        cpu = cpu_seconds(server.pid)
        tpot, seconds, tokens = mean_tpot(client(), count)
        return tpot, seconds, tokens, cpu_seconds(server.pid) - cpu
    finally:
        server.terminate()
        server.join(30)


async def mean_tpot_warm(executor: Executor, count: int) -> None:
    await run_load(executor, requests(count), concurrency=USERS, timeout_s=120)


def main() -> None:
    count = USERS * 4
    _, fast_s, fast_tokens, fast_cpu = through_http(0.0, count)
    server_rate = fast_tokens / fast_cpu
    _, _, single_tokens, single_cpu = through_http(0.0, USERS, tokens=TOKENS[:1])
    paced = USERS * 2
    direct_tpot, _, _ = mean_tpot(InstantExecutor(PACED_INTERVAL_S), paced)
    http_tpot, _, _, _ = through_http(PACED_INTERVAL_S, paced)
    print(
        json.dumps(
            {
                "name": "serve",
                "ratios": {
                    "server_tok_s_per_cpu_s_vs_20000": server_rate / NEEDED_TOK_S,
                    "tpot_http_vs_direct": http_tpot / direct_tpot,
                },
                "details": {
                    "server_tok_per_cpu_s": round(server_rate),
                    "wall_tok_s": round(fast_tokens / fast_s),
                    "server_cpu_s": round(fast_cpu, 2),
                    "server_tok_per_cpu_s_1_token_responses": round(single_tokens / single_cpu),
                    "tpot_direct_ms": round(direct_tpot * 1e3, 3),
                    "tpot_http_ms": round(http_tpot * 1e3, 3),
                    "users": USERS,
                    "tokens_per_response": len(TOKENS),
                    "cores": os.cpu_count(),
                    "load_1m": os.getloadavg()[0],
                },
            }
        )
    )


if __name__ == "__main__":
    main()
