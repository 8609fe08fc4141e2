"""Published DFlash / EAGLE-3 figures exactly as their sources state them, and the model shapes behind them
(the recorded config.json values, plus labelled assumptions for drafters whose config.json was not read).

Each `Published` point names its source document and carries only what that document states. Whatever the
source leaves open (GPU, precision, concurrency, acceptance length, lengths) is an `Unknown`: the candidate
values the evaluation runs the model over, with where those candidates come from. Nothing here is fitted; which
points are fitted and which are held out is decided in `evaluation.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from dflash_trt.analysis.model import DFlashShape, StackShape, TargetShape
from dflash_trt.analysis.shapes import dflash_from_spec, target_from_spec
from dflash_trt.decoding_modes import AR, DFLASH, EAGLE3, DecodingMode
from dflash_trt.errors import DFlashTrtError
from dflash_trt.recorded_configs import packaged_recorded_configs
from dflash_trt.spec import parse_draft_config, parse_target_config

# ---- model shapes ------------------------------------------------------------------------------------------
# Targets and the drafters whose config.json was read are the recorded configs (dflash_trt/assets/
# recorded_configs.yaml), the same values a dry run plans with. A drafter recorded there as `unknown` gets an
# assumed config below, built from its recorded target so that no recorded value is written a second time.


def _recorded(ref: str) -> dict:
    """A copy of `ref`'s recorded config.json fields, so nothing here can change what dry runs plan with."""
    entry = packaged_recorded_configs()[ref]
    if isinstance(entry, str):
        raise DFlashTrtError(f"{ref}'s config.json is not recorded ({entry})")
    return copy.deepcopy(entry)


def zlab_taps(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """z-lab's tap layers: `num_taps` target layers spread evenly from layer 1 to layer L - 3."""
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


def assumed_drafter(target_cfg: dict, *, num_layers: int, block_size: int, mask_token_id: int) -> dict:
    """A z-lab-style DFlash drafter config for `target_cfg` whose own config.json is not recorded (ASSUMED): the
    target's width, MLP width, KV heads and RoPE base, 32 query heads of 128, five taps spread z-lab's way."""
    taken = ("hidden_size", "intermediate_size", "num_key_value_heads", "rope_theta")
    return {
        "architectures": ["DFlashDraftModel"],
        **{key: target_cfg[key] for key in taken},
        "num_hidden_layers": num_layers,
        "num_attention_heads": 32,
        "head_dim": 128,
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": zlab_taps(target_cfg["num_hidden_layers"]),
        },
    }


QWEN3_4B = _recorded("Qwen/Qwen3-4B")
QWEN3_8B = _recorded("Qwen/Qwen3-8B")
QWEN3_32B = _recorded("Qwen/Qwen3-32B")
LLAMA31_8B = _recorded("meta-llama/Llama-3.1-8B-Instruct")
QWEN3_CODER_30B_A3B = _recorded("Qwen/Qwen3-Coder-30B-A3B-Instruct")
QWEN3_4B_DFLASH_B16 = _recorded("z-lab/Qwen3-4B-DFlash-b16")
QWEN3_8B_DFLASH_B16 = _recorded("z-lab/Qwen3-8B-DFlash-b16")
QWEN3_MASK_TOKEN_ID = QWEN3_8B_DFLASH_B16["dflash_config"]["mask_token_id"]  # one Qwen3 tokenizer for all sizes

# Assumed: the Llama drafter's layer count and MLP width are not published; taken like the Qwen3-8B drafter's
# (5 layers, the target's MLP width). Block 10 and mask token 128002 (a reserved Llama-3 special token) assumed too.
LLAMA31_8B_DFLASH = assumed_drafter(LLAMA31_8B, num_layers=5, block_size=10, mask_token_id=128002)
# Assumed: the third-party Qwen3-32B drafter's config is not recorded; taken as a 5-layer z-lab-style drafter of
# the target's width with 32 query / 8 KV heads and block 16.
QWEN3_32B_DFLASH = assumed_drafter(QWEN3_32B, num_layers=5, block_size=16, mask_token_id=QWEN3_MASK_TOKEN_ID)
# Assumed beyond its model card (8 layers, hidden 2048, 32 query / 4 KV heads of 128): MLP width and taps.
QWEN3_CODER_30B_A3B_DFLASH = assumed_drafter(
    QWEN3_CODER_30B_A3B, num_layers=8, block_size=16, mask_token_id=QWEN3_MASK_TOKEN_ID
)

# gpt-oss-120b is a MoE model (outside the target families the converter accepts), so its shape is written
# directly: 36 layers, hidden 2880, 64 x 64 query heads, 8 KV heads, 128 experts top-4 of width 2880,
# alternate layers windowed to 128 tokens, vocab 201088 (its config.json).
GPT_OSS_120B = TargetShape(
    stack=StackShape(
        num_layers=36, hidden=2880, intermediate=2880, num_heads=64, num_kv_heads=8, head_dim=64,
        num_experts=128, experts_per_token=4, sliding_window=128, num_sliding_layers=18,
    ),
    vocab=201088,
)  # fmt: skip
# z-lab/gpt-oss-120b-DFlash: 8 layers, 64/8/64 heads, block 10, 5 taps; MLP width derived from its 0.8B params.
GPT_OSS_120B_DFLASH = DFlashShape(
    stack=StackShape(num_layers=8, hidden=2880, intermediate=7900, num_heads=64, num_kv_heads=8, head_dim=64),
    num_taps=5,
    block_size=10,
)


def target(cfg: dict) -> TargetShape:
    return target_from_spec(parse_target_config(cfg))


def dflash(target_cfg: dict, draft_cfg: dict) -> DFlashShape:
    return dflash_from_spec(parse_draft_config(draft_cfg, parse_target_config(target_cfg)))


@dataclass(frozen=True)
class Pair:
    """A target + DFlash drafter pair and the HF ids it is published under."""

    load: Callable[[], tuple[TargetShape, DFlashShape]]
    target_id: str
    draft_id: str


PAIRS: dict[str, Pair] = {
    "qwen3-8b": Pair(
        lambda: (target(QWEN3_8B), dflash(QWEN3_8B, QWEN3_8B_DFLASH_B16)), "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"
    ),
    "qwen3-4b": Pair(
        lambda: (target(QWEN3_4B), dflash(QWEN3_4B, QWEN3_4B_DFLASH_B16)), "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"
    ),
    "llama-3.1-8b": Pair(
        lambda: (target(LLAMA31_8B), dflash(LLAMA31_8B, LLAMA31_8B_DFLASH)),
        "meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    ),
    "qwen3-32b": Pair(
        lambda: (target(QWEN3_32B), dflash(QWEN3_32B, QWEN3_32B_DFLASH)),
        "Qwen/Qwen3-32B", "AICP-Labs/qwen3-32b-dflash-en-zh",
    ),
    "qwen3-coder-30b-a3b": Pair(
        lambda: (target(QWEN3_CODER_30B_A3B), dflash(QWEN3_CODER_30B_A3B, QWEN3_CODER_30B_A3B_DFLASH)),
        "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    ),
    "gpt-oss-120b": Pair(
        lambda: (GPT_OSS_120B, GPT_OSS_120B_DFLASH), "openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash"
    ),
}  # fmt: skip


def pair_for_models(target_id: str, draft_id: str) -> str | None:
    """The PAIRS key whose HF ids are these, so a profile's shapes are known without downloading anything."""
    return next((k for k, p in PAIRS.items() if (p.target_id, p.draft_id) == (target_id, draft_id)), None)


# ---- sources ------------------------------------------------------------------------------------------------

SOURCES = {
    "zlab-readme": "z-lab/dflash README at its initial commit bb48ef9 (2026-01-05): 1x B200, transformers backend, "
    "Qwen3 thinking disabled, max_new_tokens 2048, greedy (T=0), batch 1; speedup = AR TPOT / speculative TPOT in "
    "the same harness; EAGLE-3 = RedHatAI/Qwen3-8B-speculator.eagle3",
    "dflash-paper": "DFlash paper, arXiv 2602.06036: Qwen3-8B with z-lab/Qwen3-8B-DFlash-b16, greedy, single "
    "stream (GPU, harness and acceptance lengths not recorded here)",
    "sglang-23000": "SGLang PR #23000 (spec v2, merged 2026-04): Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16, 1x B200, "
    "GSM8K, greedy, trtllm_mha target / fa4 drafter attention, spec v1 and spec v2 workers",
    "gpt-oss-card": "z-lab/gpt-oss-120b-DFlash model card: SGLang, 1x H200, reasoning effort medium, end-to-end "
    "(prefill included), GSM8K, speedups at concurrency 1, 8, 16 and 32 for draft blocks 4 and 10 (read as over "
    "AR at the same concurrency)",
    "nvidia-blog": "NVIDIA technical blog 'Boost Inference Performance up to 15x on NVIDIA Blackwell Using DFlash "
    "Speculative Decoding' (2026-06-23): gpt-oss-120b, TensorRT-LLM, eight-GPU DGX B300, SPEED-Bench coding "
    "prompts; the 500-600 tok/s/user operating point as given by its coverage (blockchain.news, TechTimes)",
    "nvidia-blog-tables": "the same blog's speedup tables as relayed by thebrieftide.com: SPEED-Bench average "
    "speedup over AR 'at a fixed number of users'",
    "sglang-16818": "SGLang PR #16818 (DFLASH, spec v1 worker; its description's last throughput and speedup tables, "
    "the flashinfer-backend section by their position): Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16, 1-8x H200, GSM8K "
    "chat prompts through benchmark/dflash/bench_dflash_gsm8k_sweep.py (bf16, greedy, thinking off, max_new_tokens "
    "2048, 128 x concurrency questions up to 1024, output tokens over wall time), DFlash tok/s and speedup over "
    "AR per TP 1/2/4/8 and concurrency 1-32; the AR baseline is DFlash tok/s / speedup",
    "sglang-20547": "SGLang PR #20547 (spec v2 for DFLASH, 2026-03-13): the same sweep script on 1x B200, "
    "concurrency 32, spec v1 9,688.26 and spec v2 12,360.49 tok/s; its concurrency-1 spec v2 figure (900 tok/s) "
    "as PR #23000 states it",
    "modelopt-vllm": "NVIDIA Model-Optimizer examples/speculative_decoding/doc/dflash.md, 'vLLM Deployment "
    "Results': vLLM nightly (v0.19.1+), H100, MT-Bench 80 prompts, 1024 max tokens: tok/s of the target alone, "
    "z-lab/Qwen3-8B-DFlash-b16 and ModelOpt's block-8 Qwen3-8B drafter at TP 1 and 8, and per MT-Bench category "
    "at TP 8 with each category's acceptance length",
}


@dataclass(frozen=True)
class Unknown:
    """A quantity the source leaves open: the candidates the evaluation runs over, and where they come from."""

    values: tuple
    why: str
    kind: str = "assumed"  # "datasheet" when the candidates are read from a named document


ORIGINAL_LENGTHS = Unknown(((256, 1024),), "assumed: no source states mean prompt/output lengths")
CARD_TAUS = Unknown(
    (3.7, 4.4, 4.6, 5.3, 5.4),
    "SPEED-Bench's acceptance length is unpublished: the gpt-oss-120b-DFlash card's block-10 values on "
    "MT-Bench, HumanEval, MBPP, GSM8K and Math500",
    "datasheet",
)
BLOG_PRECISION = Unknown(
    ("mxfp4", "nvfp4"), "the blog states no precision: gpt-oss-120b is released in MXFP4; Blackwell also runs NVFP4"
)
LLAMA_PRECISION = Unknown(("bf16", "fp8"), "the tables state no precision")
BF16_CHECKPOINTS = Unknown(
    ("bf16",), "assumed: no dtype is stated; the bf16 checkpoints run in bf16 unless quantization is asked for"
)
CARD_PRECISION = Unknown(
    ("mxfp4",),
    "derived: the card states no precision, and only the released MXFP4 weights fit one 141 GB H200 "
    "(117 B parameters x 2 B = 234 GB in bf16)",
)


@dataclass(frozen=True)
class Published:
    """One published figure and the setting it was measured in.

    metric: "speedup" = tok/s/user of `method` over `versus` at equal concurrency; "tok_s" = output tokens/s of
    the whole deployment; "ratio_at_interactivity" = tok/s/GPU of `method` over `versus` at equal tok/s/user.
    `tau` None means the source publishes no acceptance length and no other source bounds it: the point stays
    in the table but the model cannot evaluate it. `bound` ">" marks a figure stated as a lower bound.
    """

    id: str
    source: str
    pair: str
    setting: str
    metric: str
    published: float
    harness: str
    gpu: str | Unknown
    precision: str | Unknown
    concurrency: int | Unknown | None
    tau: float | Unknown | None
    method: DecodingMode = DFLASH
    versus: DecodingMode = AR
    num_gpus: int = 1
    block: int | None = None
    draft_steps: int | Unknown | None = None
    lengths: tuple[int, int] | Unknown = ORIGINAL_LENGTHS
    interactivity: float | Unknown | None = None
    bound: str = ""
    note: str = ""


# (dataset, DFlash-8B speedup, tau, DFlash-4B speedup, tau, EAGLE-3-8B speedup, tau), T=0 tables of the README.
ZLAB_ROWS = [
    ("GSM8K", 5.20, 6.55, 5.17, 6.50, 2.13, 2.89),
    ("Math500", 6.17, 7.87, 6.19, 7.84, 2.18, 2.94),
    ("AIME24", 5.91, 7.48, 6.00, 7.47, 2.25, 3.04),
    ("AIME25", 5.85, 7.31, 5.79, 7.28, 2.18, 2.93),
    ("HumanEval", 5.20, 6.55, 5.26, 6.63, 2.48, 3.36),
    ("MBPP", 4.75, 6.00, 4.87, 6.19, 2.27, 3.08),
    ("LiveCodeBench", 5.43, 7.12, 5.41, 6.97, 2.24, 3.16),
    ("SWE-Bench", 2.92, 3.69, 2.97, 3.70, 1.90, 2.55),
    ("MT-Bench", 2.79, 4.25, 2.87, 4.35, 1.94, 2.72),
    ("Alpaca", 2.27, 3.16, 2.23, 3.10, 1.88, 2.68),
]
EAGLE3_ZLAB_STEPS = Unknown(
    (7,), "not in the README; z-lab's project page: speculation length 7 for its EAGLE-3 comparison", "datasheet"
)


def _dataset_key(name: str) -> str:
    return name.lower().replace("-", "")


def _zlab() -> list[Published]:
    points = []
    for dataset, s8, t8, s4, t4, se, te in ZLAB_ROWS:
        key = _dataset_key(dataset)
        row = partial(Published, source="zlab-readme", metric="speedup", harness="hf-transformers", gpu="b200",
                      precision=BF16_CHECKPOINTS, concurrency=1)  # fmt: skip
        points += [
            row(id=f"zlab-qwen3-8b-dflash-{key}", pair="qwen3-8b", setting=f"Qwen3-8B DFlash, {dataset}",
                published=s8, tau=t8),
            row(id=f"zlab-qwen3-4b-dflash-{key}", pair="qwen3-4b", setting=f"Qwen3-4B DFlash, {dataset}",
                published=s4, tau=t4),
            row(id=f"zlab-qwen3-8b-eagle3-{key}", pair="qwen3-8b", setting=f"Qwen3-8B EAGLE-3, {dataset}",
                published=se, tau=te, method=EAGLE3, draft_steps=EAGLE3_ZLAB_STEPS),
        ]  # fmt: skip
    return points


# Acceptance length per (dataset, temperature) as the sources publish them. The z-lab README's tables at T=0 and
# T=1 (its T=1 rows came from an exact-match verifier, not rejection sampling); the gpt-oss-120b-DFlash card at
# block 10 (temperature not stated: None).
WORKLOADS = {
    "math": ("gsm8k", "math500", "aime24", "aime25"),
    "code": ("humaneval", "mbpp", "livecodebench", "swebench"),
    "chat": ("mtbench", "alpaca"),
}
_DATASETS = tuple(d for ds in WORKLOADS.values() for d in ds)
# The README's T=1 tables in the dataset order of _DATASETS (T=0: ZLAB_ROWS).
_ZLAB_T1_TAUS = {
    "qwen3-8b": (6.04, 6.57, 5.06, 5.03, 5.40, 5.17, 6.79, 2.82, 3.74, 2.88),
    "qwen3-4b": (5.98, 6.67, 4.97, 5.01, 6.05, 5.55, 6.60, 3.09, 4.03, 2.99),
}
_CARD_TAUS = {"gsm8k": 5.3, "math500": 5.4, "humaneval": 4.4, "mbpp": 4.6, "mtbench": 3.7}


def _taus() -> dict[str, dict[tuple[str, float | None], float]]:
    out: dict[str, dict[tuple[str, float | None], float]] = {"qwen3-8b": {}, "qwen3-4b": {}}
    for dataset, _, t8, _, t4, *_ in ZLAB_ROWS:
        key = _dataset_key(dataset)
        out["qwen3-8b"][(key, 0.0)], out["qwen3-4b"][(key, 0.0)] = t8, t4
    for pair, values in _ZLAB_T1_TAUS.items():
        out[pair].update({(d, 1.0): t for d, t in zip(_DATASETS, values, strict=True)})
    out["gpt-oss-120b"] = {(d, None): t for d, t in _CARD_TAUS.items()}
    return out


TAUS = _taus()
TAU_SOURCES = {
    "qwen3-8b": "z-lab README (initial commit), T=0 and T=1 tables",
    "qwen3-4b": "z-lab README (initial commit), T=0 and T=1 tables",
    "gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash card, block 10, temperature not stated",
}


def workload_taus(pair: str, workload: str, temperature: float | None) -> dict[str, float]:
    """The published acceptance lengths of `workload` (a dataset or one of WORKLOADS) for `pair` at `temperature`
    (None: whatever the source used, when it states none)."""
    taus = TAUS.get(pair)
    if not taus:
        raise DFlashTrtError(f"no acceptance length is published for {pair}: give --acceptance_length")
    datasets = WORKLOADS.get(workload, (workload,))
    temps = sorted({t for _, t in taus}, key=lambda t: -1.0 if t is None else t)
    if temperature is None and temps != [None]:
        temperature = 0.0
    found = {d: taus[(d, temperature)] for d in datasets if (d, temperature) in taus}
    if not found:
        known = sorted({d for d, _ in taus})
        temp_text = ", ".join("not stated" if t is None else f"{t:g}" for t in temps)
        raise DFlashTrtError(
            f"{pair} has no published acceptance length for workload {workload!r} at temperature {temperature} "
            f"(workloads: {', '.join([*WORKLOADS, *known])}; temperatures: {temp_text})"
        )
    return found


def _paper() -> list[Published]:
    readme_tau = {d: t8 for d, _, t8, *_ in ZLAB_ROWS}
    gpu = Unknown(("b200", "h200"), "not recorded for the paper's table; the README's B200 and an H200")
    rows = [("GSM8K", 5.15), ("Math500", 6.08), ("AIME25", 5.62), ("MT-Bench", 2.75)]
    points = [
        Published(
            f"paper-qwen3-8b-dflash-{d.lower().replace('-', '')}", "dflash-paper", "qwen3-8b",
            f"Qwen3-8B DFlash, {d}", "speedup", s, "hf-transformers", gpu, BF16_CHECKPOINTS, 1,
            Unknown((readme_tau[d],), "substituted: the paper's acceptance length is not recorded here, so the "
                    "README's for the same pair and dataset is assumed"),
            note="disagrees with the README's row for the same pair and dataset; both are kept. Harness assumed "
            "the README's (transformers)",
        )
        for d, s in rows
    ]  # fmt: skip
    points.append(
        Published("paper-qwen3-8b-dflash-mean7", "dflash-paper", "qwen3-8b", "Qwen3-8B DFlash, mean of 7 tasks",
                  "speedup", 4.86, "hf-transformers", gpu, BF16_CHECKPOINTS, 1, None,
                  note="a mean over tasks whose acceptance lengths are not all recorded: not evaluable")
    )  # fmt: skip
    return points


SGLANG_TAUS = Unknown(
    (6.35, 6.48), "the PR reports acceptance lengths 6.35 and 6.48 without tying them to a run", "datasheet"
)
# bench_dflash_gsm8k_sweep.py: zero-shot GSM8K questions plus one instruction line in Qwen3's chat template,
# answers until EOS. Neither length is reported.
SWEEP_LENGTHS = Unknown(
    ((128, 320),),
    "assumed: a GSM8K question with the sweep script's one-line instruction in Qwen3's chat template is ~100-150 "
    "tokens; non-thinking step-by-step answers end at EOS after ~200-400 tokens; neither is reported",
)
SWEEP_PRECISION = Unknown(
    ("bf16",), "the sweep script's default --dtype bfloat16; no other dtype is stated", "datasheet"
)


def _sglang() -> list[Published]:
    rows = [("v1", 1, 845.98), ("v1", 32, 11405.85), ("v2", 1, 1161.88), ("v2", 32, 15326.81)]
    older = [("v1", 32, 9688.26), ("v2", 32, 12360.49), ("v2", 1, 900.0)]
    return [
        Published(f"sglang-{v}-c{c}", "sglang-23000", "qwen3-8b", f"Qwen3-8B DFlash, spec {v}, concurrency {c}",
                  "tok_s", tok_s, f"sglang-{v}", "b200", SWEEP_PRECISION, c, SGLANG_TAUS, lengths=SWEEP_LENGTHS)
        for v, c, tok_s in rows
    ] + [
        Published(f"sglang20547-{v}-c{c}", "sglang-20547", "qwen3-8b",
                  f"Qwen3-8B DFlash, spec {v}, concurrency {c}, five weeks before PR #23000", "tok_s", tok_s,
                  f"sglang-{v}", "b200", SWEEP_PRECISION, c, SGLANG_TAUS, lengths=SWEEP_LENGTHS,
                  note="the same harness on the same GPU five weeks earlier: measures its drift")
        for v, c, tok_s in older
    ]  # fmt: skip


# PR #16818's tables, rows TP 1/2/4/8, columns concurrency 1/2/4/8/16/32.
SGLANG_16818_CONCURRENCY = (1, 2, 4, 8, 16, 32)
SGLANG_16818_TOK_S = {
    1: (774, 1422, 2562, 4335, 6366, 8335),
    2: (803, 1469, 2577, 4173, 5947, 7777),
    4: (825, 1505, 2468, 4061, 5699, 7626),
    8: (810, 1293, 2337, 3839, 5684, 7426),
}
SGLANG_16818_SPEEDUP = {
    1: (3.67, 3.42, 3.15, 2.79, 2.17, 1.66),
    2: (3.23, 2.99, 2.71, 2.36, 1.80, 1.50),
    4: (2.55, 2.47, 2.17, 1.92, 1.51, 1.28),
    8: (2.33, 1.91, 1.83, 1.65, 1.41, 1.49),
}
# The acceptance-length table the same description prints with its other attention backend's results.
SGLANG_16818_TAU = {
    1: (6.36, 6.34, 6.34, 6.36, 6.29, 6.38),
    2: (6.36, 6.40, 6.36, 6.44, 6.41, 6.43),
    4: (6.36, 6.36, 6.36, 6.31, 6.31, 6.37),
    8: (6.33, 6.31, 6.29, 6.36, 6.29, 6.30),
}


def _sglang_16818() -> list[Published]:
    points = []
    for tp, cells in SGLANG_16818_TOK_S.items():
        for i, c in enumerate(SGLANG_16818_CONCURRENCY):
            tok_s, speedup = cells[i], SGLANG_16818_SPEEDUP[tp][i]
            tau = Unknown(
                (SGLANG_16818_TAU[tp][i],),
                "assumed: the accept-length table printed with the other "
                "attention backend's results, same TP and concurrency",
            )
            row = partial(
                Published,
                source="sglang-16818",
                pair="qwen3-8b",
                harness="sglang-v1",
                gpu="h200",
                precision=SWEEP_PRECISION,
                concurrency=c,
                num_gpus=tp,
                lengths=SWEEP_LENGTHS,
            )
            where = f"TP {tp}, concurrency {c}"
            points += [
                row(id=f"sglang16818-tp{tp}-c{c}-dflash", setting=f"Qwen3-8B DFlash, {where}", metric="tok_s",
                    published=tok_s, tau=tau),
                row(id=f"sglang16818-tp{tp}-c{c}-speedup", setting=f"Qwen3-8B DFlash over AR, {where}",
                    metric="speedup", published=speedup, tau=tau),
                row(id=f"sglang16818-tp{tp}-c{c}-ar", setting=f"Qwen3-8B AR, {where}", metric="tok_s",
                    published=round(tok_s / speedup, 1), tau=1.0, method=AR,
                    note="derived: the published DFlash tok/s over the published speedup"),
            ]  # fmt: skip
    return points


# Per MT-Bench category at TP 8, per drafter: (acceptance length, tok/s); MT-Bench has 10 prompts per category.
MODELOPT_CATEGORIES: dict[str, dict[str, tuple[float, float]]] = {
    "math": {"zlab": (4.24, 1098), "modelopt": (5.14, 1238)},
    "coding": {"zlab": (3.52, 1269), "modelopt": (4.03, 1299)},
    "writing": {"zlab": (3.97, 903), "modelopt": (3.99, 1002)},
    "reasoning": {"zlab": (3.49, 1020), "modelopt": (3.89, 1188)},
    "roleplay": {"zlab": (3.37, 923), "modelopt": (3.88, 1069)},
    "extraction": {"zlab": (3.02, 789), "modelopt": (3.60, 1002)},
    "stem": {"zlab": (3.63, 914), "modelopt": (3.55, 1027)},
    "humanities": {"zlab": (2.68, 672), "modelopt": (3.05, 786)},
}
MODELOPT_LENGTHS = Unknown(
    ((128, 512),),
    "assumed: MT-Bench first turns are ~50-200 tokens; answers end at EOS below the 1024-token cap; neither is "
    "reported",
)
MODELOPT_SINGLE_USER = Unknown(
    (1,),
    "derived: the concurrency is not stated, but 145 tok/s for Qwen3-8B in bf16 on one H100 is below the single-"
    "stream bound (3.35 TB/s over 16.4 GB, ~204 tok/s): one request at a time",
)
MODELOPT_PRECISION = Unknown(("bf16",), "assumed: no dtype is stated; vLLM serves the bf16 checkpoints in bf16")


def _mean_tau(drafter: str) -> Unknown:
    taus = [cells[drafter][0] for cells in MODELOPT_CATEGORIES.values()]
    return Unknown(
        (round(sum(taus) / len(taus), 2),),
        "derived: the unweighted mean of the eight per-category acceptance lengths at TP 8 (MT-Bench holds ten "
        "prompts per category; acceptance does not depend on TP)",
    )


def _modelopt() -> list[Published]:
    row = partial(
        Published,
        source="modelopt-vllm",
        pair="qwen3-8b",
        harness="vllm",
        gpu="h100",
        metric="tok_s",
        precision=MODELOPT_PRECISION,
        concurrency=MODELOPT_SINGLE_USER,
        lengths=MODELOPT_LENGTHS,
    )
    points = [row(id=f"modelopt-tp{tp}-ar", setting=f"Qwen3-8B AR, TP {tp}", published=tok_s, tau=1.0, method=AR,
                  num_gpus=tp) for tp, tok_s in ((1, 145.0), (8, 377.0))]  # fmt: skip
    drafters = {
        "zlab": ("z-lab block-16 drafter", 16, (422.0, 919.0)),
        "modelopt": ("ModelOpt block-8 drafter", 8, (443.0, 1053.0)),
    }
    for name, (label, block, totals) in drafters.items():
        points += [
            row(id=f"modelopt-tp{tp}-{name}", setting=f"Qwen3-8B DFlash ({label}), TP {tp}", published=tok_s,
                tau=_mean_tau(name), block=block, num_gpus=tp)
            for tp, tok_s in zip((1, 8), totals, strict=True)
        ]  # fmt: skip
        points += [
            row(id=f"modelopt-tp8-{name}-{cat}", setting=f"Qwen3-8B DFlash ({label}), TP 8, MT-Bench {cat}",
                published=float(cells[name][1]), tau=cells[name][0], block=block, num_gpus=8)
            for cat, cells in MODELOPT_CATEGORIES.items()
        ]  # fmt: skip
    return points


def _card() -> list[Published]:
    rows = [(4, 3.3, [(1, 1.3), (8, 1.2), (16, 1.3), (32, 1.2)]), (10, 5.3, [(1, 1.8), (8, 1.6), (16, 1.6), (32, 1.5)])]
    lengths = Unknown(((256, 1024),), "assumed: GSM8K prompts are short; reasoning output length is not stated")
    return [
        Published(
            f"card-gpt-oss-120b-b{block}-c{c}", "gpt-oss-card", "gpt-oss-120b",
            f"gpt-oss-120b DFlash, block {block}, concurrency {c}", "speedup", s, "sglang-v2", "h200",
            CARD_PRECISION, c, tau, block=block, lengths=lengths,
            note="the model ignores the prefill share of end-to-end time"
            + ("; the recorded excerpt was cut right after this value" if c == 32 else ""),
        )
        for block, tau, cells in rows
        for c, s in cells
    ]  # fmt: skip


def _blog() -> list[Published]:
    b300x8 = partial(
        Published,
        gpu="b300",
        num_gpus=8,
        precision=BLOG_PRECISION,
        harness="trtllm",
        lengths=Unknown(((1024, 1024),), "assumed: SPEED-Bench prompt and output lengths are not stated"),
    )
    band = Unknown((500.0, 600.0), "the blog's band: 500-600 tok/s/user", "datasheet")
    # 8 GPUs stay the blog's setup for gpt-oss-120b; the GPU model is what the tables leave open.
    table_gpu = Unknown(("b300",), "assumed: the tables name no GPU; the blog's gpt-oss-120b runs are on DGX B300")
    fixed_users = Unknown((1, 4, 16, 64), "the tables say 'at a fixed number of users' without the number")
    return [
        b300x8("blog-gpt-oss-120b-dflash-vs-ar-band", "nvidia-blog", "gpt-oss-120b",
                  "gpt-oss-120b DFlash vs AR at 500-600 tok/s/user", "ratio_at_interactivity", 15.0,
                  concurrency=None, tau=CARD_TAUS, interactivity=band, bound=">",
                  note="stated as more than 15x the throughput (the concurrent users) of AR at that interactivity"),
        b300x8("blog-gpt-oss-120b-dflash-vs-eagle3-band", "nvidia-blog", "gpt-oss-120b",
                  "gpt-oss-120b DFlash vs EAGLE-3 at 500-600 tok/s/user", "ratio_at_interactivity", 1.5,
                  concurrency=None, tau=None, versus=EAGLE3, interactivity=band,
                  note="EAGLE-3's acceptance length and draft length are unpublished: not evaluable"),
        b300x8("blog-gpt-oss-120b-dflash-speed-bench", "nvidia-blog-tables", "gpt-oss-120b",
                  "gpt-oss-120b DFlash, SPEED-Bench average", "speedup", 2.3, concurrency=fixed_users, tau=CARD_TAUS,
                  gpu=table_gpu),
        b300x8("blog-gpt-oss-120b-eagle3-speed-bench", "nvidia-blog-tables", "gpt-oss-120b",
                  "gpt-oss-120b EAGLE-3, SPEED-Bench average", "speedup", 1.7, concurrency=fixed_users, tau=None,
                  method=EAGLE3, gpu=table_gpu, note="EAGLE-3's acceptance length is unpublished: not evaluable"),
        Published("blog-llama-3.1-8b-dflash-speed-bench", "nvidia-blog-tables", "llama-3.1-8b",
                  "Llama-3.1-8B-Instruct DFlash, SPEED-Bench average", "speedup", 2.8,
                  gpu=Unknown(("b200", "b300", "h200"), "the tables name no GPU"), precision=LLAMA_PRECISION,
                  harness="trtllm", concurrency=fixed_users, tau=None,
                  note="no source gives this drafter's acceptance length: not evaluable"),
        Published("blog-llama-3.1-8b-eagle3-speed-bench", "nvidia-blog-tables", "llama-3.1-8b",
                  "Llama-3.1-8B-Instruct EAGLE-3, SPEED-Bench average", "speedup", 2.2,
                  gpu=Unknown(("b200", "b300", "h200"), "the tables name no GPU"), precision=LLAMA_PRECISION,
                  harness="trtllm", concurrency=fixed_users, tau=None, method=EAGLE3,
                  note="EAGLE-3's acceptance length is unpublished: not evaluable"),
    ]  # fmt: skip


POINTS: list[Published] = _zlab() + _paper() + _sglang() + _sglang_16818() + _modelopt() + _card() + _blog()


# The rows each harness's overhead terms are fitted on, chosen before fitting; every other row is held out.
# The transformers harness: two pairs' single-user speedups (their different rooflines separate the per-step and
# the speculative overhead). SGLang spec v1: the four corners (TP 1 and 8, concurrency 1 and 32) of PR #16818's
# DFlash throughput and its derived AR baseline, which settle how much of the overhead AR pays, how it grows with
# the batch and what tensor parallelism costs. SGLang spec v2: PR #23000's two throughputs (its AR side is
# spec v1's). vLLM: the AR baseline at TP 1 and 8 and the block-16 drafter at TP 1.
FIT_ROWS: dict[str, tuple[str, ...]] = {
    "hf-transformers": ("zlab-qwen3-8b-dflash-gsm8k", "zlab-qwen3-4b-dflash-gsm8k"),
    "sglang-v1": tuple(f"sglang16818-tp{tp}-c{c}-{m}" for tp in (1, 8) for c in (1, 32) for m in ("ar", "dflash")),
    "sglang-v2": ("sglang-v2-c1", "sglang-v2-c32"),
    "vllm": ("modelopt-tp1-ar", "modelopt-tp8-ar", "modelopt-tp1-zlab"),
}
# Rows that measure one harness twice, five weeks apart (newer, older): the drift a calibration carries.
DRIFT_PAIRS = (
    ("sglang-v1-c32", "sglang20547-v1-c32"),
    ("sglang-v2-c32", "sglang20547-v2-c32"),
    ("sglang-v2-c1", "sglang20547-v2-c1"),
)


def point(point_id: str) -> Published:
    found = [p for p in POINTS if p.id == point_id]
    if len(found) != 1:
        raise DFlashTrtError(f"no published point {point_id!r}")
    return found[0]
