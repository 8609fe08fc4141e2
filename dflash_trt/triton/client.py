"""Stream one prompt through a DFlash Triton repository over gRPC; print the text and the drafter's acceptance.

Standalone (tritonclient + numpy) so the copy written into every repository runs on any client machine:
    python client.py --url localhost:8001 --prompt "Write a haiku about GPUs." --max_tokens 128
"""

from __future__ import annotations

import argparse
import math
import queue
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Generation:
    text: str = ""
    chunks: int = 0  # responses carrying text_output (an empty piece where a character is held back): one per iteration
    seconds: float = 0.0
    acceptance_rate: float | None = None
    accepted_draft_tokens: int | None = None
    draft_tokens: int | None = None
    errors: list[str] = field(default_factory=list)


def acceptance_length(accepted: int, chunks: int) -> float:
    """Tokens gained per verification step, bonus token included. A streamed request answers once per engine
    iteration: the context step's first token, then one response per verify step, so the steps are counted, not
    derived from the drafted total (a draft tree verifies its nodes, a schedule varies the drafts per step: neither
    is a fixed number of drafts per step)."""
    steps = chunks - 1
    return math.nan if steps <= 0 else (accepted + steps) / steps


def request_inputs(
    prompt: str, max_tokens: int, temperature: float | None, stop_words: list[str], seed: int | None = None
):
    """The ensemble's inputs for one request (batch of 1), streaming and perf metrics on."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, array: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = [
        tensor("text_input", np.array([[prompt.encode("utf-8")]], dtype=object), "BYTES"),
        tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        tensor("stream", np.array([[True]], dtype=bool), "BOOL"),
        tensor("return_perf_metrics", np.array([[True]], dtype=bool), "BOOL"),
    ]
    if temperature is not None:
        inputs.append(tensor("temperature", np.array([[temperature]], dtype=np.float32), "FP32"))
    if seed is not None:
        inputs.append(tensor("random_seed", np.array([[seed]], dtype=np.uint64), "UINT64"))
    if stop_words:
        words = np.array([[w.encode("utf-8") for w in stop_words]], dtype=object)
        inputs.append(tensor("stop_words", words, "BYTES"))
    return inputs


def _scalar(result, name: str):
    value = result.as_numpy(name)
    return None if value is None else value.reshape(-1)[0].item()


def stream_generate(
    url: str,
    prompt: str,
    max_tokens: int,
    *,
    model: str = "ensemble",
    temperature: float | None = None,
    stop_words: Sequence[str] = (),
    on_text=None,
    timeout_s: float = 600.0,
    seed: int | None = None,
) -> Generation:
    """Send one streaming request and collect every response until the server marks the last one."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)
    out = Generation()
    start = time.perf_counter()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(
            model,
            request_inputs(prompt, max_tokens, temperature, list(stop_words), seed),
            request_id=uuid.uuid4().hex,  # lets the ensemble hold back a character split between responses
            enable_empty_final_response=True,
        )
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                out.errors.append(str(error))
                break
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                piece = b"".join(text.reshape(-1)).decode("utf-8", errors="replace")
                out.text += piece
                out.chunks += 1
                if on_text is not None:
                    on_text(piece)
            for attr, name in (
                ("acceptance_rate", "acceptance_rate"),
                ("accepted_draft_tokens", "total_accepted_draft_tokens"),
                ("draft_tokens", "total_draft_tokens"),
            ):
                value = _scalar(result, name)
                if value is not None:
                    setattr(out, attr, value)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    out.seconds = time.perf_counter() - start
    return out


def summary(gen: Generation) -> str:
    """The chunks, the backend's draft totals (per draft verified: a tree's nodes count each) and the tokens per
    verify step."""
    parts = [f"{gen.chunks} chunks in {gen.seconds:.2f} s"]
    if gen.acceptance_rate is not None:
        parts.append(f"acceptance rate {gen.acceptance_rate:.3f} per draft verified")
    if gen.accepted_draft_tokens is not None and gen.draft_tokens is not None:
        parts.append(f"accepted {gen.accepted_draft_tokens}/{gen.draft_tokens} draft tokens")
        if gen.chunks > 1:
            length = acceptance_length(gen.accepted_draft_tokens, gen.chunks)
            parts.append(f"mean acceptance length {length:.2f} over {gen.chunks - 1} verify steps")
    return ", ".join(parts)


def server_unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """None when a Triton server answers at `url`; otherwise what to do about it, in one line."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url=url)
    try:
        if client.is_server_live(client_timeout=timeout_s):
            return None
        problem = "is not live"
    except InferenceServerException as exc:
        problem = f"cannot be reached ({' '.join(str(exc).split())[:120]})"
    finally:
        client.close()
    script = Path(__file__).with_name("launch_triton.sh")
    return (
        f"no Triton server at {url}: it {problem}; start one with {script} "
        "(TRITONSERVER=/path/to/tritonserver when it is not on PATH) and wait until its models are READY"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    parser.add_argument("--seed", type=int, default=None, help="random seed of a sampled request")
    parser.add_argument("--stop_words", nargs="*", default=[])
    args = parser.parse_args(argv)
    problem = server_unreachable(args.url)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    gen = stream_generate(
        args.url,
        args.prompt,
        args.max_tokens,
        model=args.model,
        temperature=args.temperature,
        stop_words=args.stop_words,
        on_text=lambda t: print(t, end="", flush=True),
        seed=args.seed,
    )
    print()
    if gen.errors:
        print("error: " + "; ".join(gen.errors), file=sys.stderr)
        return 1
    print(summary(gen), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
