"""Which attention kernel serves each pass of a DFlash engine, decided at build time from the GPU it is built for.

TensorRT-LLM 1.2.x's GPT attention plugin runs multi-token (spec-decoding) generation only through XQA, and its
XQA dispatcher sends SM100-family GPUs (B200, B300) to TRTLLM-GEN kernels that refuse speculative decoding, so the
first generation step of an EAGLE-style engine asserts there [read: xqaDispatcher.cpp, attentionOp.cpp; the
evidence table is docs/engine.md §13]. On those GPUs both generation passes (the target's verification of K + 1
tokens, the drafter's block) run on our `DFlashAttention` plugin. Spec-decoding (tree) attention has no sliding
window on any GPU, so sliding-window draft layers run on `DFlashAttention` everywhere, with the window applied.
Context (prefill) attention stays on the stock plugin. A draft tree's verification reads the runtime's packed tree
mask and position offsets on either kernel (`check_tree` states the one limit). Nothing here imports TensorRT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_trt.errors import DFlashTrtError
from dflash_trt.gpu_targets import visible_gpu

STOCK = "GPTAttention"  # tensorrt_llm's plugin
OURS = "DFlashAttention"  # dflash_trt's plugin (libdflash_trt_plugins.so)
HOPPER_SMS = (90,)
BLACKWELL_SMS = (100, 103)  # what TensorRT-LLM's isSM100Family() covers
SUPPORTED_SMS = HOPPER_SMS + BLACKWELL_SMS
# What the route rests on and how far it was checked (docs/engine.md §13, docs/plugin.md), printed beside it.
ROUTE_EVIDENCE = (
    "stock spec-decoding attention has no kernel on SM100/SM103 and no sliding window in TensorRT-LLM 1.2.x [read in "
    "its sources, docs/engine.md §13]; DFlashAttention's kernels were run as a lane-exact host simulation and the "
    "routed network under the emulation, not yet on a GPU (tests/gpu/ is ready for one)"
)
# A draft tree's verification reads the runtime's packed tree mask (and position offsets), on either kernel.
TREE_MASK = "with the packed tree mask"
# The most nodes DFlashAttention's tree verification was checked for (host simulation, up to 257 rows and 9 mask
# words): EAGLE's own bound on max_draft_len, so no engine's tree is refused by it today.
OURS_TREE_NODES = 256
# Set by `dflash-trt build` for trtllm-build (the network reads it while it is built); without it the network
# takes the SM of the GPU the build runs on.
TARGET_SM_ENV = "DFLASH_TRT_TARGET_SM"


@dataclass(frozen=True)
class AttentionRoute:
    """The kernel of each attention pass for one GPU generation (compute capability x 10)."""

    sm: int

    def __post_init__(self) -> None:
        if self.sm not in SUPPORTED_SMS:
            raise DFlashTrtError(
                f"DFlash engines are built for SM{'/'.join(map(str, SUPPORTED_SMS))} GPUs (H100/H200, B200, B300), "
                f"not SM{self.sm}"
            )

    @property
    def target_generation(self) -> str:
        """The target's verification of K + 1 tokens (generation requests; context requests stay stock)."""
        return OURS if self.sm in BLACKWELL_SMS else STOCK

    def draft_layer(self, sliding: bool) -> str:
        """The drafter's block pass through one draft layer."""
        return OURS if sliding or self.sm in BLACKWELL_SMS else STOCK

    def check_tree(self, gpu: str, nodes: int) -> None:
        """Whether a draft tree of `nodes` nodes verifies on `gpu`. A tree's verification reads the runtime's packed
        tree mask and position offsets: stock XQA does on Hopper, `DFlashAttention` does with block_mask 2 (its
        host-simulated kernel was checked up to OURS_TREE_NODES nodes; the plugin takes no window with a tree, and
        the target's verification has none)."""
        if self.target_generation == OURS and nodes > OURS_TREE_NODES:
            raise DFlashTrtError(
                f"--draft_tree {nodes}: on {gpu} the target's verification runs on {OURS}, whose tree mask is checked "
                f"up to {OURS_TREE_NODES} nodes"
            )

    def describe(self, layer_types: tuple[str, ...], tree: bool = False) -> dict[str, str]:
        """The kernel of each pass, for dflash_trt.json and the dry run; draft layers by their kinds; a tree's
        verification says it reads the packed tree mask."""
        verification = f"{self.target_generation} {TREE_MASK}" if tree else self.target_generation
        passes = {"target_context": STOCK, "target_verification": verification}
        for kind in sorted(set(layer_types)):
            passes[f"draft_block_{kind}"] = self.draft_layer(kind == "sliding_attention")
        return passes


def route_summary(gpu: str, passes: dict[str, str]) -> list[str]:
    """The lines a build prints before it starts (and a dry run instead): each pass's kernel on `gpu`, and why."""
    return [
        f"attention on {gpu}: " + ", ".join(f"{name} {kernel}" for name, kernel in passes.items()),
        f"attention route: {ROUTE_EVIDENCE}",
    ]


def route_for_build() -> AttentionRoute:
    """The route the network is built with: `DFLASH_TRT_TARGET_SM` (set by dflash-trt build), else the GPU this
    build runs on (trtllm-build run by hand)."""
    value = os.environ.get(TARGET_SM_ENV)
    if value is not None:
        if not value.isdigit():
            raise DFlashTrtError(f"{TARGET_SM_ENV} must be a compute capability x 10 (90, 100, 103), got {value!r}")
        return AttentionRoute(int(value))
    visible = visible_gpu()
    if visible is None:
        raise DFlashTrtError(
            f"no GPU is visible to choose the attention kernels for; set {TARGET_SM_ENV} or build with dflash-trt build"
        )
    return AttentionRoute(visible[1])
