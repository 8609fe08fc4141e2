"""Users one node serves at a per-user speed: the best TP x replicas x batch for each decoding method.

A node of N GPUs runs N / tp replicas of one engine. For each tensor-parallel width whose heads divide, the
largest batch per replica that still gives every user at least the asked tok/s/user (tok/s/user falls as the
batch grows) and that fits in memory and the engine limits (`memory.py`) is searched; users per node =
replicas x that batch. The method's best layout is the one with the most users. Comparing methods at one
per-user speed is what NVIDIA's ">15x the users of AR at 500-600 tok/s/user" measures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_trt.analysis.gpus import GPUS, get_gpu
from dflash_trt.analysis.memory import EngineLimits, batch_limit, budget, draft_len
from dflash_trt.analysis.model import Calibration, Deployment, Method, TargetShape, mean_context
from dflash_trt.checkpoint.sharding import tp_refusal
from dflash_trt.decoding_modes import AR
from dflash_trt.errors import DFlashTrtError

NODE_PATTERN = re.compile(r"^(\d+)x([a-z0-9]+)$")


def parse_node(text: str) -> tuple[int, str]:
    """'8xb300' -> (8, 'b300')."""
    m = NODE_PATTERN.match(text.strip().lower())
    if not m or m.group(2) not in GPUS or int(m.group(1)) < 1:
        raise DFlashTrtError(f"--node must look like 8xb300 (a GPU count x one of {', '.join(GPUS)}), got {text!r}")
    return int(m.group(1)), m.group(2)


@dataclass(frozen=True)
class Layout:
    """One method's best layout on the node: replicas of a tp-wide engine, each running `batch` users."""

    method: str
    tp: int
    replicas: int
    batch: int
    tok_s_user: float
    tok_s_node: float
    limit: str  # what stops the batch growing: the per-user target, or the memory / engine limit

    @property
    def users(self) -> int:
        return self.replicas * self.batch

    def as_json(self) -> dict:
        return {**vars(self), "users": self.users}


def _heads_divide(target: TargetShape, method: Method, tp: int) -> bool:
    stacks = [target.stack] + ([method.drafter.stack] if method.drafter is not None else [])
    return all(tp_refusal(s.num_heads, s.num_kv_heads, s.intermediate, tp) is None for s in stacks)


def best_layout(
    method: Method,
    target: TargetShape,
    num_gpus: int,
    gpu: str,
    precision: str,
    kv_dtype: str,
    cal: Calibration,
    lengths: tuple[int, int],
    min_tok_s_user: float,
    max_num_tokens: int = EngineLimits.max_num_tokens,
) -> Layout | None:
    """The layout serving the most users at >= `min_tok_s_user` each (None: no layout reaches that speed)."""
    ctx = mean_context(*lengths)
    best: Layout | None = None
    for tp in (t for t in range(1, num_gpus + 1) if num_gpus % t == 0 and _heads_divide(target, method, t)):
        dep = Deployment(get_gpu(gpu), precision, kv_dtype, tp, cal)
        k = draft_len(method)
        limits = EngineLimits(max_batch_size=EngineLimits.max_batch_size, max_num_tokens=max_num_tokens)
        cap = batch_limit(budget(target, method.drafter, dep, limits, k), limits, *lengths, k, 10**9, dep)
        if cap.batch == 0:
            continue

        def speed(b: int, dep: Deployment = dep) -> float:
            return method.iteration(target, b, ctx, dep).tok_s_user()

        if speed(1) < min_tok_s_user:
            continue
        lo, hi = 1, cap.batch  # speed(lo) meets the target; find the largest batch that does
        if speed(hi) >= min_tok_s_user:
            lo, limit = hi, cap.reason
        else:
            limit = f"{min_tok_s_user:g} tok/s/user"
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if speed(mid) >= min_tok_s_user else (lo, mid)
        it = method.iteration(target, lo, ctx, dep)
        layout = Layout(
            method.name,
            tp,
            num_gpus // tp,
            lo,
            it.tok_s_user(),
            num_gpus // tp * lo * it.tokens_per_seq / it.seconds,
            limit,
        )
        if best is None or (layout.users, layout.tok_s_node) > (best.users, best.tok_s_node):
            best = layout
    return best


@dataclass(frozen=True)
class NodeRow:
    """Every method's best layout under one calibration and one acceptance length."""

    label: str  # the calibration and the acceptance lengths it was planned with
    layouts: dict[str, Layout | None]

    def ratio(self, method: str) -> float | None:
        """Users over AR's users; None when either serves nobody at the target (AR not at all: unbounded)."""
        ar, other = self.layouts.get(AR), self.layouts.get(method)
        return None if ar is None or other is None else other.users / ar.users


def plan_node(
    methods: dict[str, list[Method]],
    target: TargetShape,
    node: str,
    precision: str,
    kv_dtype: str,
    cal: Calibration,
    lengths: tuple[int, int],
    min_tok_s_user: float,
) -> list[NodeRow]:
    """One row per acceptance variant; `methods` maps a name to its variants (one per acceptance length; AR has
    one)."""
    num_gpus, gpu = parse_node(node)
    if min_tok_s_user <= 0:
        raise DFlashTrtError(f"--min_tok_s_user must be a positive number, got {min_tok_s_user}")
    width = max(len(v) for v in methods.values())
    rows = []
    for i in range(width):
        chosen = {name: variants[min(i, len(variants) - 1)] for name, variants in methods.items()}
        taus = ", ".join(f"{n} tau {m.acceptance.mean():.2f}" for n, m in chosen.items() if m.acceptance is not None)
        layouts = {
            name: best_layout(m, target, num_gpus, gpu, precision, kv_dtype, cal, lengths, min_tok_s_user)
            for name, m in chosen.items()
        }
        rows.append(NodeRow(f"{cal.name}; {taus}" if taus else cal.name, layouts))
    return rows


def markdown_node(node: str, rows: list[NodeRow]) -> str:
    """One table row per planned variant and method: the layout, users, and users over AR's."""
    lines = []
    for r in rows:
        for name, lay in r.layouts.items():
            if lay is None:
                lines.append(f"| {node} | {r.label} | {name} | – | 0 | – | – |")
                continue
            ratio = r.ratio(name)
            vs = "–" if name == AR else ("AR reaches none" if ratio is None else f"{ratio:.2f}×")
            lines.append(
                f"| {node} | {r.label} | {name} | tp {lay.tp} × {lay.replicas} × {lay.batch} | {lay.users} | "
                f"{lay.tok_s_node:,.0f} | {vs} |"
            )
    return "\n".join(lines)
