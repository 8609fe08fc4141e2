"""Plan a DFlash engine build without TensorRT-LLM: validate, then spell the exact `trtllm-build` call.

Everything that can be decided on a CPU machine lives here, so `dflash-trt build --dry_run`, build profiles and the
tests see the same rules the GPU build applies. The limits below are TensorRT-LLM 1.2.x facts (docs/engine.md cites
the source of each); the engine speaks the runtime's EAGLE contract with one chain of the drafter's drafts
(`block_size - 1`, or `block_size` when the anchor's slot drafts too).
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dflash_trt import __version__
from dflash_trt.checkpoint.trtllm_config import ARCHITECTURE, specs_from_config
from dflash_trt.draft_schedule import AUTO, FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import FP8, FP8_CONTEXT_FMHA_WEIGHTS, NONE, NVFP4, QFORMATS, fp8_context_fmha, quant_algo
from dflash_trt.gpu_targets import ASSUMED_GPU, gpu_sm
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE, DRAFT_TREE, draft_tree_nodes
from dflash_trt.jsonfile import read_json_object
from dflash_trt.reference.loop_rules import longest_request
from dflash_trt.rope import RopeConfig
from dflash_trt.sampling_rules import ENGINE_SAMPLING, HONOURED
from dflash_trt.spec import SLIDING_ATTENTION, TARGET_ARCHITECTURES, DraftSpec
from dflash_trt.trtllm.attention_route import OURS, TARGET_SM_ENV, AttentionRoute
from dflash_trt.trtllm.plugin import LIBRARY_ENV, PLUGIN_NAMESPACE, default_library_path

TRTLLM_BUILD = "trtllm-build"
MODEL_CLASS_NAME = ARCHITECTURE
BASE_ARCHITECTURES = TARGET_ARCHITECTURES
SPECULATIVE_DECODING_MODE = "eagle"
# tensorrt_llm.models.modeling_utils.SpeculativeDecodingMode is an IntFlag of auto() members; EAGLE is the sixth.
EAGLE_MODE_VALUE = 1 << 5
MANIFEST_NAME = "dflash_trt.json"
MANIFEST_FORMAT = 1
PLUGIN_LIBRARY_ENV = LIBRARY_ENV
# The draft-length schedule trtllm-build builds into the network: the checkpoint's config.json (which trtllm-build
# reads) is the converter's and holds none, so `dflash-trt build` hands the resolved table over in this variable.
SCHEDULE_ENV = "DFLASH_TRT_DRAFT_LEN_SCHEDULE"
# The draft tree trtllm-build builds into the network: the checkpoint's config.json (which trtllm-build reads) is the
# converter's and holds none, so `dflash-trt build` hands the node count over in this variable.
TREE_ENV = "DFLASH_TRT_DRAFT_TREE"
REQUIRED_TRTLLM = "1.2"
# Builds one TP rank per process for `--workers` > 1 (trtllm-build's own workers cannot load our class).
RANK_BUILD_MODULE = "dflash_trt.trtllm.rank_build"
# builder.build() asserts both for SpeculativeDecodingMode.EAGLE.
MAX_EAGLE_BATCH_SIZE = 512
MAX_EAGLE_DRAFT_LEN = 256
# TensorRT's ITopKLayer takes K <= 3840 (TensorRT 10 operator documentation) [read]: DFlash2's candidates per slot.
TOPK_MAX_K = 3840
# How the engine verifies drafts: greedy at temperature 0, exact-match sampling above (trtllm/verify.py).
SAMPLING_POLICY = ENGINE_SAMPLING
GEMM_PLUGIN_CHOICES = ("auto", "float16", "bfloat16", "float32", "fp8", "nvfp4", "disable")
# GEMM plugins that only run weights quantized in the format they are named after.
QUANTIZED_GEMM_PLUGINS = (FP8, NVFP4)
# Stock spec-decoding generation runs only through XQA. Its HMMA kernels (the only ones for an fp16/bf16 KV cache,
# and the portable ones for FP8 KV) take these paged-KV block sizes; only Hopper's FP8-KV GMMA kernels also take 8.
# cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/decoderXQAImplJIT/kernelUtils.cpp, supportConfigHMMA.
# DFlashAttention takes them too (any power of two).
XQA_TOKENS_PER_BLOCK = (16, 32, 64, 128)
# Head dims DFlashAttention's kernels are instantiated for (plugins/include/dflash_trt/attentionMath.h).
DFLASH_ATTENTION_HEAD_DIMS = (32, 64, 128, 256)
# KV-cache block size: trtllm-build's plugin-config default (read in the 1.2.x sources). It is also the unit of a
# context chunk, so the smallest prefill chunk a step can carry.
TOKENS_PER_BLOCK = 32
KV_CACHE_TYPES = ("paged",)
LOGITS_DTYPES = ("float32", "float16")
# Length defaults for a model that allows them; `dflash-trt build` lowers them to what the checkpoint allows.
DEFAULT_MAX_SEQ_LEN = 8192
DEFAULT_MAX_INPUT_LEN = 4096
# trtllm-build flags that set a value the plan sets under another name, or replace the plan's settings wholesale
# (read in the 1.2.x sources of tensorrt_llm/commands/build.py, not run): refused after `--` like the plan's own.
OVERRIDING_BUILD_FLAGS = ("--max_decoder_seq_len", "--paged_kv_cache", "--build_config", "--model_config")


@dataclass(frozen=True)
class EngineBuildSettings:
    """The `trtllm-build` knobs a DFlash engine exposes; defaults suit one H200/B300 serving a few dozen users."""

    max_batch_size: int = 64
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    max_num_tokens: int = 8192
    max_beam_width: int = 1
    gemm_plugin: str = "auto"
    use_paged_context_fmha: bool = True
    # None: what builder.build() settles on for the checkpoint (`fp8_context_fmha`); a value that differs is refused.
    use_fp8_context_fmha: bool | None = None
    multiple_profiles: bool = False
    kv_cache_type: str = "paged"
    tokens_per_block: int = TOKENS_PER_BLOCK
    logits_dtype: str = "float32"
    workers: int = 1
    extra_flags: tuple[str, ...] = ()
    # The GPU the engine is built for (and runs on): it decides the attention kernel of each pass.
    gpu: str = ASSUMED_GPU

    @property
    def route(self) -> AttentionRoute:
        return AttentionRoute(gpu_sm(self.gpu))

    # Resolved before planning (`auto` is the planner's, analysis/draft_schedule.py); built in via SCHEDULE_ENV.
    draft_len_schedule: DraftLenSchedule = FIXED
    draft_tree: int | None = None  # nodes of the draft tree verified per request; None: the chain


@dataclass(frozen=True)
class CheckpointFacts:
    """What the build needs from a converted checkpoint's config.json, already validated."""

    base_architecture: str
    dtype: str
    num_target_layers: int
    target_heads: int
    target_kv_heads: int
    target_head_size: int
    num_draft_layers: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_size: int
    block_size: int
    max_draft_len: int  # drafts per step: block_size - 1, or block_size when the anchor's slot drafts
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    causal: tuple[bool, ...]
    sliding_window: int | None
    tp_size: int
    pp_size: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    target_rope: RopeConfig
    draft_rope: RopeConfig
    max_position_embeddings: int
    draft_quant_algo: str | None = None
    draft_kv_cache_quant_algo: str | None = None
    sparse_layers: tuple[int, ...] = ()  # mixture-of-experts layers of a Qwen3-MoE target
    drafter: dict[str, Any] = field(default_factory=dict)  # what the manifest records about the drafter's kind
    selector_top_k: int | None = None  # DFlash2's candidates per slot


@dataclass(frozen=True)
class EngineLengths:
    """How the max_seq_len a build is given becomes the lengths its engine records and runs, so a dry run can say why
    the engine's config.json holds more than was asked for [read: builder.py `build`, llmRequest.cpp `validate`]."""

    max_seq_len: int  # the build's --max_seq_len
    max_draft_len: int  # K, the draft positions per step (a draft tree's depth)
    draft_nodes: int  # the drafts verified per step, the engine's EAGLE max_draft_len: K for a chain, N for a tree
    positions: int | None  # the target's RoPE rows every request must stay within; None: not known yet

    @property
    def engine_max_seq_len(self) -> int:
        """What config.json and dflash_trt.json record."""
        return built_max_seq_len(self.max_seq_len, self.draft_nodes, self.max_draft_len)

    @property
    def longest_request(self) -> int:
        return engine_longest_request(self.max_seq_len, self.max_draft_len)

    @property
    def last_position(self) -> int:
        """The largest position the longest request's last step reaches: its next draft block, 2K past its end."""
        return self.longest_request + 2 * self.max_draft_len - 1

    @property
    def last_slot(self) -> int:
        """The largest KV slot the longest request's last step writes: its next draft block's, or (a tree's) the
        verified nodes', N past its anchor (its last-but-one token) before the rewind."""
        return max(self.last_position, self.longest_request - 2 + self.draft_nodes)

    def explanation(self) -> str:
        k, n = self.max_draft_len, self.draft_nodes
        added = f"2 x {k}" if n == k else f"{n} + {k}"
        tree = "" if n == k else f" a draft tree of {n} nodes over {k} positions:"
        text = (
            f"--max_seq_len {self.max_seq_len}:{tree} the engine records max_seq_len {self.engine_max_seq_len} = "
            f"{self.max_seq_len} + {added} (TensorRT-LLM 1.2.x's builder adds max_draft_len, and num_eagle_layers for "
            f"EAGLE); its executor runs requests of up to {self.longest_request} tokens (prompt + output + {n} drafts "
            f"<= {self.engine_max_seq_len}), whose last step reaches position {self.last_position}"
        )
        if n != k:
            text += f" and KV slot {self.last_slot} (the verified tree, before the rewind)"

        if self.positions is None:
            return text
        return f"{text} (the target's max_position_embeddings RoPE tables hold positions 0..{self.positions - 1})"

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "engine_max_seq_len": self.engine_max_seq_len,
            "longest_request": self.longest_request,
            "last_position": self.last_position,
            "last_slot": self.last_slot,
            "explanation": self.explanation(),
        }


@dataclass(frozen=True)
class EngineBuildPlan:
    """The exact build: argv for `trtllm-build`, the BuildConfig dict it implies, and the manifest to write."""

    checkpoint_dir: str
    output_dir: str
    command: list[str]
    build_config: dict[str, Any]
    plugin_library: str
    dflash_manifest: dict[str, Any]
    settings: EngineBuildSettings = field(repr=False)
    lengths: EngineLengths
    world_size: int = 1

    @property
    def parallel_workers(self) -> int:
        """Ranks built at once; 1 means one trtllm-build process building rank after rank."""
        return max(1, min(self.settings.workers, self.world_size))

    def rank_commands(self, command: list[str] | None = None, python: str = "python") -> list[list[str]]:
        """One `rank_build` process per rank for a parallel build (see rank_build.py), else nothing."""
        if self.parallel_workers == 1:
            return []
        args = (command or self.command)[1:]
        return [
            [python, "-m", RANK_BUILD_MODULE, "--rank", str(rank), "--gpus", str(self.parallel_workers), "--", *args]
            for rank in range(self.world_size)
        ]

    def build_env(self) -> dict[str, str]:
        """What the build processes need in their environment beyond the caller's (`build_environment`)."""
        return build_environment(self.settings)

    def shell_command(self, with_library: bool = False) -> str:
        """The build as a shell line with the variables the network is built from; `with_library` also sets the
        plugin library and the planned GPU's SM, as `dflash-trt build` runs it (without them, a line run by hand on a
        GPU host builds for that host's GPU, `route_for_build`)."""
        variables = self.build_env()
        if not with_library:
            variables.pop(TARGET_SM_ENV)
        env = environment_prefix({**({LIBRARY_ENV: self.plugin_library} if with_library else {}), **variables})
        if self.parallel_workers == 1:
            return env + shlex.join(self.command)
        one_rank = [
            "python",
            "-m",
            RANK_BUILD_MODULE,
            "--rank",
            "{}",
            "--gpus",
            str(self.parallel_workers),
            "--",
            *self.command[1:],
        ]
        return f"seq 0 {self.world_size - 1} | {env}xargs -P {self.parallel_workers} -I{{}} {shlex.join(one_rank)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_dir": self.checkpoint_dir,
            "output_dir": self.output_dir,
            "command": list(self.command),
            "build_config": self.build_config,
            "plugin_library": self.plugin_library,
            "dflash_manifest": self.dflash_manifest,
            "lengths": self.lengths.to_dict(),
        }


def build_environment(settings: EngineBuildSettings) -> dict[str, str]:
    """The variables the model class reads while trtllm-build builds it (the converted config.json trtllm-build loads
    holds none of them): the GPU's SM (its attention route), the draft-length schedule, and a draft tree's node
    count."""
    tree = {} if settings.draft_tree is None else {TREE_ENV: str(settings.draft_tree)}
    return {TARGET_SM_ENV: str(settings.route.sm), SCHEDULE_ENV: settings.draft_len_schedule.text(), **tree}


def environment_prefix(environment: dict[str, str]) -> str:
    return "".join(f"{name}={shlex.quote(value)} " for name, value in environment.items())


def engine_schedule(text: str | None, max_draft_len: int) -> DraftLenSchedule:
    """The schedule a network is built with: `text` (the `draft_len_schedule` key of an engine's config.json, or of
    the config the emulation builds), else `$DFLASH_TRT_DRAFT_LEN_SCHEDULE` (set by `dflash-trt build` for
    trtllm-build), else `none`. `auto` must already be resolved into a table: the network cannot plan."""
    source = "draft_len_schedule" if text is not None else SCHEDULE_ENV
    value = text if text is not None else os.environ.get(SCHEDULE_ENV, "none")
    schedule = DRAFT_LEN_SCHEDULE.check(value, source)
    if schedule == AUTO:
        raise DFlashTrtError(
            f"{source} is auto, which only dflash-trt build and plan resolve (for a GPU, TP and acceptance); "
            "give the table they print"
        )
    assert isinstance(schedule, DraftLenSchedule)
    return schedule.fitted_to(max_draft_len, source)


def engine_tree_nodes(value: int | None, num_drafts: int, dflash2: bool) -> int:
    """Nodes of the draft tree a network is built with, 0 for the chain: `value` (the `draft_tree` key of an
    engine's config.json, or of the config the emulation builds), else `$DFLASH_TRT_DRAFT_TREE` (set by `dflash-trt
    build` for trtllm-build), else the chain."""
    if value is not None:
        return check_tree_nodes(DRAFT_TREE.check(value, "draft_tree"), num_drafts, dflash2, "draft_tree")
    text = os.environ.get(TREE_ENV)
    if text is None:
        return 0
    try:
        nodes = DRAFT_TREE.parse(text)
    except ValueError:
        raise DFlashTrtError(f"{TREE_ENV} must be {DRAFT_TREE.describe()}, got {text!r}") from None
    return check_tree_nodes(DRAFT_TREE.check(nodes, TREE_ENV), num_drafts, dflash2, TREE_ENV)


def check_tree_nodes(nodes: int | None, num_drafts: int, dflash2: bool, what: str = "--draft_tree") -> int:
    """0 for the chain, `nodes` for a tree (the golden loop's rule, `inputs.draft_tree_nodes`), at most what an
    EAGLE engine verifies (the builder's max_draft_len limit)."""
    tree = draft_tree_nodes(nodes, num_drafts, dflash2, what)
    if tree > MAX_EAGLE_DRAFT_LEN:
        raise DFlashTrtError(f"{what} {tree}: an EAGLE engine verifies at most {MAX_EAGLE_DRAFT_LEN} drafts")
    return tree


def chain_eagle_choices(max_draft_len: int) -> list[list[int]]:
    """EAGLE choices of one chain: [[0], [0, 0], ...], depth `max_draft_len` (the runtime checks depth == layers)."""
    return [[0] * depth for depth in range(1, max_draft_len + 1)]


def chain_draft_paths(max_draft_len: int) -> list[list[int]]:
    """The `draft_paths` rows a chain produces: row 0 visits every node, the other K rows are unused (-1)."""
    width = max_draft_len + 1
    return [list(range(width))] + [[-1] * width for _ in range(max_draft_len)]


def vocab_blocks(padded_vocab: int) -> tuple[int, int]:
    """(blocks, block width) of the engine's two-level inverse CDF (trtllm/verify.py), about sqrt(V) each: every fp32
    prefix sum then runs over a small mass, so rounding moves a token's probability by ~1e-7 of its block's mass
    rather than of the whole distribution."""
    width = math.isqrt(padded_vocab - 1) + 1
    return -(-padded_vocab // width), width


def block_mask(block_size: int, causal: bool) -> list[list[bool]]:
    """Which block tokens each block query sees: all (DFlash full attention) or itself and earlier (causal)."""
    return [[(not causal) or key <= query for key in range(block_size)] for query in range(block_size)]


def pack_mask_rows(mask: list[list[bool]]) -> list[list[int]]:
    """Pack each row into int32 words, bit j of word w = key 32*w + j (the spec-decoding packed-mask layout)."""
    words = math.ceil(len(mask[0]) / 32)
    packed = []
    for row in mask:
        row_words = []
        for w in range(words):
            value = 0
            for bit in range(32):
                key = 32 * w + bit
                if key < len(row) and row[key]:
                    value |= 1 << bit
            row_words.append(value - (1 << 32) if value >= 1 << 31 else value)
        packed.append(row_words)
    return packed


def block_packed_mask(block_size: int, causal: bool) -> list[list[int]]:
    return pack_mask_rows(block_mask(block_size, causal))


def read_checkpoint_facts(checkpoint_dir: str | Path) -> CheckpointFacts:
    """Read the converted checkpoint's config.json back into specs (the converter's contract) and keep the facts."""
    path = Path(checkpoint_dir) / "config.json"
    config = read_json_object(
        path, f"checkpoint directory {checkpoint_dir} has no config.json; run `dflash-trt convert` first"
    )
    target, draft = specs_from_config(config)
    if target.architecture not in BASE_ARCHITECTURES:
        raise DFlashTrtError(
            f"{path}: base architecture {target.architecture!r} is not one of {', '.join(BASE_ARCHITECTURES)}"
        )
    if config.get("max_draft_len") != draft.num_drafts:
        raise DFlashTrtError(f"{path}: max_draft_len must equal the drafter's drafts per step, {draft.num_drafts}")
    mapping = config.get("mapping") or {}
    quant = config.get("quantization") or {}
    draft_quant = config["dflash_config"].get("quantization") or {}
    return CheckpointFacts(
        base_architecture=target.architecture,
        dtype=str(config.get("dtype")),
        num_target_layers=target.num_hidden_layers,
        target_heads=target.num_attention_heads,
        target_kv_heads=target.num_key_value_heads,
        target_head_size=target.head_dim,
        num_draft_layers=draft.num_hidden_layers,
        draft_heads=draft.num_attention_heads,
        draft_kv_heads=draft.num_key_value_heads,
        draft_head_size=draft.head_dim,
        block_size=draft.block_size,
        mask_token_id=draft.mask_token_id,
        target_layer_ids=tuple(draft.target_layer_ids),
        layer_types=tuple(draft.layer_types),
        causal=tuple(draft.causal),
        sliding_window=draft.sliding_window,
        tp_size=int(mapping.get("tp_size", 1)),
        pp_size=int(mapping.get("pp_size", 1)),
        quant_algo=quant.get("quant_algo"),
        kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
        target_rope=target.rope,
        draft_rope=draft.rope,
        max_position_embeddings=target.max_position_embeddings,
        draft_quant_algo=draft_quant.get("quant_algo"),
        draft_kv_cache_quant_algo=draft_quant.get("kv_cache_quant_algo"),
        sparse_layers=target.moe.sparse_layers if target.moe is not None else (),
        max_draft_len=draft.num_drafts,
        drafter=drafter_record(draft),
        selector_top_k=None if draft.dflash2 is None else draft.dflash2.selector_top_k,
    )


def drafter_record(draft: DraftSpec) -> dict[str, Any]:
    """The drafter's kind as `dflash_trt.json` states it."""
    conv = draft.dflash2
    return {
        "architecture": draft.architecture,
        "checkpoint_format": draft.checkpoint_format,
        "sample_from_anchor": draft.sample_from_anchor,
        "draft_vocab_size": draft.draft_vocab_size,
        "dflash2": None if conv is None else dict(vars(conv)),
    }


def check_kv_geometry(facts: CheckpointFacts) -> None:
    """Refuse drafters whose K/V pages cannot share the target's paged pool.

    The engine config carries one `head_size` for every layer of the pool, and the runtime's EAGLE KV rewind walks
    all layers with one per-layer stride, so draft layers must match the target's kv heads and head size.
    """
    if facts.draft_head_size != facts.target_head_size or facts.draft_kv_heads != facts.target_kv_heads:
        raise DFlashTrtError(
            f"the drafter's KV geometry ({facts.draft_kv_heads} kv heads x {facts.draft_head_size}) differs from the "
            f"target's ({facts.target_kv_heads} x {facts.target_head_size}); the TensorRT-LLM 1.2.x shared KV pool "
            "cannot hold it, so this pair can be converted and verified but not built into an engine. Building it "
            "would need one head_size for every layer (the engine config has one), per-layer kv heads "
            "(1.2.x's num_kv_heads_per_layer, one pool per head count behind host_kv_cache_pool_mapping) and an "
            "EAGLE KV rewind that walks each pool with its own stride (1.2.x's rewind takes one)"
        )


def rank_heads(heads: int, kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one tensor-parallel rank: KV heads are replicated below tp [read: layers/attention.py
    `Attention.__init__`, ceil division]."""
    return heads // tp_size, -(-kv_heads // tp_size)


def check_qk_norm_heads(facts: CheckpointFacts) -> None:
    """Refuse q/k-normed attention whose rank holds as many query heads as KV heads, more than one.

    1.2.x's `Attention.forward` reads the fused qkv rows of such a layer interleaved per head ([q_h, k_h, v_h] for
    each head h) before its q/k norms, and as [Q | K | V] otherwise [read: layers/attention.py `Attention.forward`,
    qk_layernorm branch]; the checkpoint holds [Q | K | V] (one head per rank reads the same either way). Every DFlash
    draft layer has q/k norms, and so do Qwen3 targets; Llama targets have none.
    """
    layers = [("drafter", facts.draft_heads, facts.draft_kv_heads)]
    if facts.base_architecture != "LlamaForCausalLM":
        layers.append(("target", facts.target_heads, facts.target_kv_heads))
    for who, heads, kv_heads in layers:
        per_rank = rank_heads(heads, kv_heads, facts.tp_size)
        if per_rank[0] == per_rank[1] > 1:
            raise DFlashTrtError(
                f"the {who}'s attention holds {per_rank[0]} query and {per_rank[1]} KV heads per rank (tp_size "
                f"{facts.tp_size}) with q/k norms: TensorRT-LLM 1.2.x's Attention then reads the fused qkv rows "
                "interleaved per head, not in the [Q | K | V] order the checkpoint holds, so this pair can be "
                "converted and verified but not built"
            )


# Hopper's XQA kernel (mha_sm90.cu) has a small-batch spec-decoding layout for q_seq_len x heads per KV head <= 32 (the
# SPEC_Q_SEQ_LEN specialisation, swapping GEMM operands) whose mask is a hard-coded lower triangle: it never reads the
# packed mask [read: cpp/kernels/xqa/mha_sm90.cu @ 014dadcd, `warpGrpApplyMask` under SWAP_AB && SPEC_DEC].
XQA_SWAP_AB_LIMIT = 32


def check_xqa_block_layout(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """Refuse a drafter whose bidirectional block could meet that layout with an FP8 KV cache (the Hopper kernel for
    FP8 caches): its all-ones mask would silently become causal, which no output of the engine would show. Only
    bidirectional layers the route leaves on the stock kernel count: where DFlashAttention runs the block (B200 /
    B300, sliding layers everywhere) its block_mask field is the mask. A draft tree's verification on the stock
    kernel meets the same layout when its N + 1 rows times the target's query heads per KV head fit in it.

    The JIT compiler wrapper read (nvrtcWrapper.cpp @ 029e0a7c and @ 7c9600c5) never defines SPEC_Q_SEQ_LEN, so 1.2.x
    should compile the layout that reads the mask; the newest stored kernelUtils.cpp says a later wrapper does
    define it, and which one the 1.2.x release carries could not be pinned, so the plan refuses rather than hopes.
    No shipped profile is affected: their drafters have 4-8 query heads per KV head and 16-token blocks.
    """
    route = settings.route
    if kv_cache_format(facts) != FP8:
        return
    if settings.draft_tree is not None and route.target_generation != OURS:
        check_xqa_tree_layout(facts, settings.draft_tree)
    on_stock = [
        not causal and route.draft_layer(kind == SLIDING_ATTENTION) != OURS
        for kind, causal in zip(facts.layer_types, facts.causal, strict=True)
    ]
    if not any(on_stock):
        return
    heads, kv_heads = rank_heads(facts.draft_heads, facts.draft_kv_heads, facts.tp_size)
    rows = heads // kv_heads * facts.block_size
    if rows <= XQA_SWAP_AB_LIMIT:
        raise DFlashTrtError(
            f"with an FP8 KV cache the drafter's block ({facts.block_size} tokens x {heads // kv_heads} query heads "
            f"per KV head = {rows} rows <= {XQA_SWAP_AB_LIMIT}) may run in Hopper XQA's small-batch spec-decoding "
            "layout, whose mask is hard-coded causal: the drafter's bidirectional block would silently turn causal. "
            "Build with --kv_cache_dtype none, or a drafter with more query heads per KV head or larger blocks"
        )


def check_xqa_tree_layout(facts: CheckpointFacts, nodes: int) -> None:
    """The target's verification of a tree of `nodes` nodes on Hopper XQA with an FP8 cache (see above)."""
    heads, kv_heads = rank_heads(facts.target_heads, facts.target_kv_heads, facts.tp_size)
    rows = heads // kv_heads * (nodes + 1)
    if rows <= XQA_SWAP_AB_LIMIT:
        raise DFlashTrtError(
            f"--draft_tree {nodes}: with an FP8 KV cache the target's verification ({nodes + 1} tokens x "
            f"{heads // kv_heads} query heads per KV head = {rows} rows <= {XQA_SWAP_AB_LIMIT}) may run in Hopper "
            "XQA's small-batch spec-decoding layout, whose mask is hard-coded causal: the tree would be verified as "
            "a chain. Build with --kv_cache_dtype none or a larger tree"
        )


def check_rope(facts: CheckpointFacts) -> None:
    """Target and drafter each get their own RoPE tables (model.py builds the drafter's from its parameters), but
    both through TensorRT-LLM 1.2.x's table builder, which reads a subset of yarn's parameters."""
    for who, rope in (("target", facts.target_rope), ("drafter", facts.draft_rope)):
        if rope.rope_type == "yarn" and (rope.attention_factor is not None or not rope.truncate):
            raise DFlashTrtError(
                f"the {who}'s yarn RoPE sets attention_factor or truncate=false, which TensorRT-LLM 1.2.x's yarn "
                "tables do not read (they take factor, original_max_position_embeddings, beta_fast/slow and "
                "mscale/_all_dim)"
            )


def check_quantization(facts: CheckpointFacts) -> None:
    """TensorRT-LLM quantizes every Linear and attention KV of the model from one QuantConfig, and the KV pool has
    one dtype, so the drafter must use the target's weight and KV-cache formats."""
    target = (facts.quant_algo, facts.kv_cache_quant_algo)
    draft = (facts.draft_quant_algo, facts.draft_kv_cache_quant_algo)
    if draft != target:

        def spelled(algos: tuple) -> str:
            return f"weights {algos[0] or 'unquantized'}, KV cache {algos[1] or 'unquantized'}"

        raise DFlashTrtError(
            f"the drafter is quantized as {spelled(draft)} but the target as {spelled(target)}; one engine applies "
            "one quantization (weights, KV cache) to both, so convert them with the same formats"
        )


def check_gemm_plugin(gemm_plugin: str, weights_qformat: str) -> None:
    """An fp8 / nvfp4 GEMM plugin runs only weights quantized in that format (the rule profiles apply too)."""
    if gemm_plugin in QUANTIZED_GEMM_PLUGINS and weights_qformat != gemm_plugin:
        raise DFlashTrtError(f"gemm_plugin {gemm_plugin} needs {gemm_plugin} weights, but they are {weights_qformat}")


def resolved_gemm_plugin(gemm_plugin: str, weights_qformat: str) -> str:
    """The GEMM plugin the engine gets. For NVFP4 weights builder.build() replaces every choice but an explicit
    `disable` by nvfp4 [read: builder.py `build`, plugin.py `PluginConfig.from_arguments`], so the plan says nvfp4
    itself for `auto` and refuses a dtype plugin the engine would not get."""
    check_gemm_plugin(gemm_plugin, weights_qformat)
    if weights_qformat != NVFP4 or gemm_plugin in ("disable", NVFP4):
        return gemm_plugin
    if gemm_plugin == "auto":
        return NVFP4
    raise DFlashTrtError(
        f"gemm_plugin {gemm_plugin} with nvfp4 weights: TensorRT-LLM 1.2.x's builder replaces it by nvfp4 (only "
        "`disable` keeps TensorRT's own GEMMs), so give auto, nvfp4 or disable"
    )


def weights_qformat(facts: CheckpointFacts) -> str:
    """The checkpoint's weight format under our --qformat names."""
    by_algo = {quant_algo(qformat): qformat for qformat in QFORMATS}
    return by_algo.get(facts.quant_algo, str(facts.quant_algo))


def kv_cache_format(facts: CheckpointFacts) -> str:
    """The checkpoint's KV-cache format under our --kv_cache_dtype names."""
    return FP8 if facts.kv_cache_quant_algo == quant_algo(FP8) else NONE


def check_kv_cache_format(weights: str, kv_cache: str) -> None:
    """Unquantized weights with an FP8 KV cache cannot run: the builder turns paged context FMHA off for them (no FP8
    context FMHA without FP8 weights), its EAGLE branch turns it back on, and the attention plugin then has 16-bit
    queries over an e4m3 paged cache, which 1.2.x's FMHA dispatcher refuses when the engine loads off the SM100
    family [read: fmhaDispatcher.cpp `FmhaDispatcher`, "KV cache data type ... is not the same as input data type"]
    and for which B200 / B300 need a context kernel not reported to exist (docs/engine.md §1.1)."""
    if kv_cache == FP8 and weights not in FP8_CONTEXT_FMHA_WEIGHTS:
        raise DFlashTrtError(
            f"an FP8 KV cache needs fp8 or nvfp4 weights in a TensorRT-LLM 1.2.x EAGLE engine, but they are {weights}: "
            "the builder re-enables paged context FMHA (EAGLE needs it) without FP8 context FMHA, leaving 16-bit "
            "queries over an FP8 paged cache, which the attention plugin's context kernels do not take (refused when "
            "the engine loads on H100 / H200); convert with --qformat fp8 or nvfp4, or with --kv_cache_dtype none "
            "(the golden model still decodes this checkpoint)"
        )


def check_fp8_context_fmha(requested: bool | None, weights: str, kv_cache: str) -> None:
    """A use_fp8_context_fmha the builder would override is refused rather than printed and then not built."""
    settled = fp8_context_fmha(weights, kv_cache)
    if requested is None or requested == settled:
        return
    if requested:
        raise DFlashTrtError(
            "use_fp8_context_fmha needs kv_cache_dtype fp8 and fp8 or nvfp4 weights: TensorRT-LLM 1.2.x's builder "
            "turns it off otherwise"
        )
    raise DFlashTrtError(
        f"use_fp8_context_fmha cannot be off with {weights} weights and an FP8 KV cache: TensorRT-LLM 1.2.x's builder "
        "turns it on, since the paged context FMHA EAGLE needs reads the FP8 cache through it; leave it unset"
    )


def resolve_settings(facts: CheckpointFacts, settings: EngineBuildSettings) -> EngineBuildSettings:
    """`settings` with every value builder.build() would settle itself written out, so the command leaves it nothing
    to override and the BuildConfig and dflash_trt.json say what the engine holds."""
    weights, kv_cache = weights_qformat(facts), kv_cache_format(facts)
    check_kv_cache_format(weights, kv_cache)
    check_fp8_context_fmha(settings.use_fp8_context_fmha, weights, kv_cache)
    return replace(
        settings,
        gemm_plugin=resolved_gemm_plugin(settings.gemm_plugin, weights),
        use_fp8_context_fmha=fp8_context_fmha(weights, kv_cache),
    )


def check_rank_files(checkpoint_dir: Path, facts: CheckpointFacts) -> None:
    """Every rank's weights must be there before trtllm-build spends minutes on the first rank."""
    from dflash_trt.conversion.convert import rank_file  # the converter imports torch; a plan reads no tensor

    ranks = range(facts.tp_size * facts.pp_size)
    missing = [rank_file(r) for r in ranks if not (checkpoint_dir / rank_file(r)).is_file()]
    if missing:
        raise DFlashTrtError(
            f"checkpoint directory {checkpoint_dir} lacks {', '.join(missing)} (tp_size {facts.tp_size}); "
            "convert it again"
        )


def check_moe_layers(facts: CheckpointFacts) -> None:
    """TensorRT-LLM 1.2.x's QWenDecoderLayer builds every layer of a qwen3_moe config as MixtureOfExperts (it reads
    no per-layer sparsity), so a target that keeps dense MLPs on some layers converts and decodes in the golden
    model but cannot be built."""
    if facts.sparse_layers and len(facts.sparse_layers) != facts.num_target_layers:
        dense = sorted(set(range(facts.num_target_layers)) - set(facts.sparse_layers))
        raise DFlashTrtError(
            f"the target keeps dense MLPs on layers {dense} among its mixture-of-experts layers; TensorRT-LLM 1.2.x's "
            "Qwen3-MoE decoder layers are all sparse, so this pair can be converted and verified but not built"
        )


def engine_longest_request(max_seq_len: int, max_draft_len: int) -> int:
    """The longest request (prompt + output) TensorRT-LLM 1.2.x's executor runs on an engine built with `max_seq_len`:
    builder.build() makes the engine's own max_seq_len L = max_seq_len + N + K (`built_max_seq_len`; N = K for a
    chain), and `LlmRequest::validate` clips a request's output so that prompt + output + N <= L (its maxDraftLen is
    the engine's, N) [read: builder.py `build`, llmRequest.cpp `validate`], so a tree's N cancels."""
    return max_seq_len + max_draft_len


def longest_max_seq_len(positions: int, max_draft_len: int) -> int:
    """The largest max_seq_len whose engine runs only requests `positions` positions hold (`loop_rules.longest_request`:
    a request's last step reaches 2K positions past its last token): positions - 3K."""
    return longest_request(positions, max_draft_len) - max_draft_len


def engine_lengths(facts: CheckpointFacts, settings: EngineBuildSettings) -> EngineLengths:
    """The lengths an engine built with these settings records and runs, and the positions they must stay within
    (the target's RoPE tables; a sliding-window drafter's window is applied by DFlashAttention, so it bounds
    nothing)."""
    return EngineLengths(
        max_seq_len=settings.max_seq_len,
        max_draft_len=facts.max_draft_len,
        draft_nodes=verified_drafts(facts, settings),
        positions=facts.max_position_embeddings,
    )


def longest_buildable(facts: CheckpointFacts) -> int:
    """The largest max_seq_len this checkpoint allows: the one whose requests its positions hold."""
    return longest_max_seq_len(facts.max_position_embeddings, facts.max_draft_len)


def fit_lengths(
    checkpoint_dir: str | Path,
    settings: EngineBuildSettings,
    max_seq_len: int | None,
    max_input_len: int | None,
    max_num_tokens: int | None,
) -> EngineBuildSettings:
    """`settings` with the lengths not given derived from the model, as trtllm-build derives max_seq_len:
    max_seq_len = min(8192, what the checkpoint allows), max_input_len = min(4096, max_seq_len); and
    max_num_tokens not given written out as the builder clips it, min(its default, max_seq_len x max_batch_size), so
    the plan leaves the builder nothing to change (a value given above that is refused by `check_settings`)."""
    facts = read_checkpoint_facts(checkpoint_dir)
    seq_len = max_seq_len if max_seq_len is not None else min(DEFAULT_MAX_SEQ_LEN, max(1, longest_buildable(facts)))
    input_len = max_input_len if max_input_len is not None else min(DEFAULT_MAX_INPUT_LEN, seq_len)
    num_tokens = max_num_tokens
    if num_tokens is None:
        num_tokens = min(settings.max_num_tokens, seq_len * settings.max_batch_size)
    return replace(settings, max_seq_len=seq_len, max_input_len=input_len, max_num_tokens=num_tokens)


def check_extra_flags(settings: EngineBuildSettings) -> None:
    """Flags after `--` may only add to the command: one the plan sets (or a prefix trtllm-build's argparse would
    expand to one) would win over the checked value while the BuildConfig and dflash_trt.json still claim ours."""
    ours = [token for token in build_command("C", "O", 1, replace(settings, extra_flags=())) if token.startswith("--")]
    for token in settings.extra_flags:
        name = token.split("=", 1)[0]
        if not name.startswith("--") or name == "--":
            continue
        taken = [flag for flag in (*ours, *OVERRIDING_BUILD_FLAGS) if flag.startswith(name)]
        if taken:
            raise DFlashTrtError(
                f"the trtllm-build flag {name} after `--` would override {taken[0]}, which dflash-trt build sets "
                "and checks itself; give it as a dflash-trt build flag, and after `--` only flags it does not set"
            )


def check_attention_route(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """What the layers DFlashAttention serves on this GPU must be: a head dim its kernels are built for."""
    route = settings.route
    served = []
    if route.target_generation == OURS:
        served.append(("target", facts.target_head_size))
    kinds = set(facts.layer_types)
    if any(route.draft_layer(kind == SLIDING_ATTENTION) == OURS for kind in kinds):
        served.append(("drafter", facts.draft_head_size))
    for who, head_dim in served:
        if head_dim not in DFLASH_ATTENTION_HEAD_DIMS:
            raise DFlashTrtError(
                f"on {settings.gpu} the {who}'s generation attention runs on DFlashAttention, whose kernels take "
                f"head dims {', '.join(map(str, DFLASH_ATTENTION_HEAD_DIMS))}, not {head_dim}"
            )


def check_positions(facts: CheckpointFacts, max_seq_len: int) -> None:
    """Every position the engine uses must have a row in the RoPE tables: the attention plugin reads the cos/sin table
    of `max_position_embeddings` rows at the token's position with no bound check [read: functional.py
    `RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin`, unfusedAttentionKernels
    `applyBiasRopeUpdateKVCacheV2`], so a position past it reads other memory. The requests the executor runs on the
    engine (`engine_longest_request`) must be ones the tables hold (`loop_rules.longest_request`)."""
    k = facts.max_draft_len
    runs = engine_longest_request(max_seq_len, k)
    if runs > longest_request(facts.max_position_embeddings, k):
        raise DFlashTrtError(
            f"max_seq_len {max_seq_len} lets the executor run requests of {runs} tokens (`engine_longest_request`: "
            f"max_seq_len + {k}), whose last step reaches position {runs + 2 * k - 1}, past the "
            f"{facts.max_position_embeddings} rows of the target's max_position_embeddings RoPE tables: build with "
            f"--max_seq_len <= {longest_max_seq_len(facts.max_position_embeddings, k)}"
        )


def check_settings(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """Every rule `trtllm-build` or the EAGLE runtime would enforce later (or silently override), as one message."""
    check_engine_settings(settings)
    check_settings_against_checkpoint(facts, settings)


def check_engine_settings(settings: EngineBuildSettings) -> None:
    """The rules on the build settings alone, before any checkpoint is known (build profiles check them too)."""
    if settings.max_beam_width != 1:
        raise DFlashTrtError("speculative decoding engines support only --max_beam_width 1")
    if settings.kv_cache_type not in KV_CACHE_TYPES:
        raise DFlashTrtError(
            f"--kv_cache_type must be paged (EAGLE-mode engines need the paged KV cache), got "
            f"{settings.kv_cache_type!r}"
        )
    if not settings.use_paged_context_fmha:
        raise DFlashTrtError("EAGLE-mode engines need --use_paged_context_fmha enable")
    if settings.gemm_plugin not in GEMM_PLUGIN_CHOICES:
        raise DFlashTrtError(f"--gemm_plugin must be one of {', '.join(GEMM_PLUGIN_CHOICES)}")
    if settings.logits_dtype not in LOGITS_DTYPES:
        raise DFlashTrtError(
            "--logits_dtype must be float32 or float16 (the dtypes the in-graph verification is checked for)"
        )
    if not 1 <= settings.max_batch_size <= MAX_EAGLE_BATCH_SIZE:
        raise DFlashTrtError(f"--max_batch_size must lie in [1, {MAX_EAGLE_BATCH_SIZE}] for EAGLE-mode engines")
    if settings.max_input_len < 1 or settings.max_input_len > settings.max_seq_len:
        raise DFlashTrtError("--max_input_len must be at least 1 and at most --max_seq_len")
    if settings.workers < 1:
        raise DFlashTrtError("--workers must be at least 1")
    if settings.tokens_per_block not in XQA_TOKENS_PER_BLOCK:
        raise DFlashTrtError(
            f"--tokens_per_block must be one of {', '.join(map(str, XQA_TOKENS_PER_BLOCK))}: speculative decoding "
            "generates through XQA, whose kernels for fp16/bf16 KV caches take no other block size"
        )
    if settings.max_num_tokens > settings.max_seq_len * settings.max_batch_size:
        raise DFlashTrtError(
            f"--max_num_tokens ({settings.max_num_tokens}) exceeds max_seq_len x max_batch_size = "
            f"{settings.max_seq_len * settings.max_batch_size}, which TensorRT-LLM 1.2.x's builder would clip it to"
        )


def verified_drafts(facts: CheckpointFacts, settings: EngineBuildSettings) -> int:
    """Drafts the engine verifies per request, its EAGLE max_draft_len: the chain's, or the draft tree's nodes."""
    dflash2 = facts.selector_top_k is not None
    return check_tree_nodes(settings.draft_tree, facts.max_draft_len, dflash2) or facts.max_draft_len


def check_settings_against_checkpoint(facts: CheckpointFacts, settings: EngineBuildSettings) -> None:
    """The rules that need the checkpoint: its drafts per step (or tree), selector, block width and positions."""
    if facts.max_draft_len > MAX_EAGLE_DRAFT_LEN:
        raise DFlashTrtError(
            f"the drafter's {facts.max_draft_len} drafts per step exceed the EAGLE limit of {MAX_EAGLE_DRAFT_LEN}"
        )
    k = verified_drafts(facts, settings)
    if facts.selector_top_k is not None and facts.selector_top_k > TOPK_MAX_K:
        raise DFlashTrtError(
            f"the DFlash2 selector's top-k ({facts.selector_top_k}) exceeds TensorRT's TopK limit of {TOPK_MAX_K}"
        )
    width = k + 1
    if settings.max_num_tokens < settings.max_batch_size * width:
        raise DFlashTrtError(
            f"--max_num_tokens ({settings.max_num_tokens}) must be at least max_batch_size x (drafts + 1) = "
            f"{settings.max_batch_size} x {width} = {settings.max_batch_size * width}: every generation step "
            "verifies the drafts and the anchor of each request"
        )
    check_positions(facts, settings.max_seq_len)
    check_gemm_plugin(settings.gemm_plugin, weights_qformat(facts))
    settings.draft_len_schedule.fitted_to(k)
    if facts.pp_size != 1:
        raise DFlashTrtError("pipeline parallelism is not supported: the drafter needs target taps from every layer")


def _switch(flag: bool) -> str:
    return "enable" if flag else "disable"


def model_class_file() -> Path:
    """The file `trtllm-build --model_cls_file` loads; it registers DFlashForCausalLM in MODEL_MAP on import."""
    return Path(__file__).with_name("model.py")


def build_command(checkpoint_dir: str, output_dir: str, max_draft_len: int, settings: EngineBuildSettings) -> list[str]:
    """The trtllm-build command line of `resolve_settings`' output (every value the builder settles written out)."""
    assert settings.use_fp8_context_fmha is not None, "build_command takes resolved settings"
    return [
        TRTLLM_BUILD,
        "--checkpoint_dir",
        checkpoint_dir,
        "--output_dir",
        output_dir,
        "--model_cls_file",
        str(model_class_file()),
        "--model_cls_name",
        MODEL_CLASS_NAME,
        "--speculative_decoding_mode",
        SPECULATIVE_DECODING_MODE,
        "--max_draft_len",
        str(max_draft_len),
        "--max_batch_size",
        str(settings.max_batch_size),
        "--max_input_len",
        str(settings.max_input_len),
        "--max_seq_len",
        str(settings.max_seq_len),
        "--max_num_tokens",
        str(settings.max_num_tokens),
        "--max_beam_width",
        str(settings.max_beam_width),
        "--kv_cache_type",
        settings.kv_cache_type,
        "--gemm_plugin",
        settings.gemm_plugin,
        "--use_paged_context_fmha",
        _switch(settings.use_paged_context_fmha),
        "--use_fp8_context_fmha",
        _switch(settings.use_fp8_context_fmha),
        "--multiple_profiles",
        _switch(settings.multiple_profiles),
        "--tokens_per_block",
        str(settings.tokens_per_block),
        "--logits_dtype",
        settings.logits_dtype,
        # trtllm-build's worker pool cannot load our class: ranks run in parallel as separate processes instead.
        "--workers",
        "1",
        *settings.extra_flags,
    ]


def build_config_dict(facts: CheckpointFacts, settings: EngineBuildSettings) -> dict[str, Any]:
    """The dict `trtllm-build` hands to `BuildConfig.from_dict` for this command line (before build() adjusts it)."""
    return {
        "max_input_len": settings.max_input_len,
        "max_seq_len": settings.max_seq_len,
        "max_batch_size": settings.max_batch_size,
        "max_beam_width": settings.max_beam_width,
        "max_num_tokens": settings.max_num_tokens,
        "kv_cache_type": settings.kv_cache_type.upper(),
        "strongly_typed": True,
        "gather_context_logits": False,
        "max_draft_len": verified_drafts(facts, settings),
        "speculative_decoding_mode": EAGLE_MODE_VALUE,
        "plugin_config": {
            "gemm_plugin": None if settings.gemm_plugin == "disable" else settings.gemm_plugin,
            "use_paged_context_fmha": settings.use_paged_context_fmha,
            "use_fp8_context_fmha": settings.use_fp8_context_fmha,
            "multiple_profiles": settings.multiple_profiles,
            "tokens_per_block": settings.tokens_per_block,
            "paged_kv_cache": True,
            "remove_input_padding": True,
            "context_fmha": True,
        },
    }


def engine_config(facts: CheckpointFacts, settings: EngineBuildSettings) -> dict[str, Any]:
    """What the engine's own config.json must hold for these resolved settings: the build_config fields the command
    sets or builder.build() adjusts (max_seq_len + 2K, opt_num_tokens, the plugin dtype, paged context FMHA), and the
    pretrained_config fields runners read. `check_engine_config` holds a built engine to it [read: builder.py
    `build`, `BuildConfig.to_dict`, `EngineConfig.to_dict`; _utils.py `check_max_num_tokens`]."""
    opt_num_tokens = None
    if not settings.multiple_profiles:
        opt_num_tokens = min(settings.max_batch_size * settings.max_beam_width, settings.max_num_tokens)
    build_config = build_config_dict(facts, settings)
    build_config.update(max_seq_len=engine_max_seq_len(facts, settings), opt_num_tokens=opt_num_tokens)
    build_config["plugin_config"]["dtype"] = facts.dtype
    return {
        "build_config": build_config,
        "pretrained_config": {
            "architecture": MODEL_CLASS_NAME,
            "dtype": facts.dtype,
            "quantization": {"quant_algo": facts.quant_algo, "kv_cache_quant_algo": facts.kv_cache_quant_algo},
        },
    }


def config_differences(recorded: Any, built: Any, where: str = "") -> list[str]:
    """Every leaf of `recorded` the built config does not hold, as `path: built X, recorded Y`."""
    if isinstance(recorded, dict):
        if not isinstance(built, dict):
            return [f"{where}: built {built!r}, recorded an object"]
        return [
            line
            for key, value in recorded.items()
            for line in config_differences(value, built.get(key), f"{where}.{key}" if where else key)
        ]
    return [] if recorded == built else [f"{where}: built {built!r}, recorded {recorded!r}"]


def check_engine_config(engine_dir: str | Path) -> None:
    """A built engine's config.json must hold what its dflash_trt.json recorded (`engine_config`): otherwise the dry
    run, the manifest and the engine disagree, and what was checked is not what was built."""
    engine_dir = Path(engine_dir)
    manifest_path = engine_dir / MANIFEST_NAME
    recorded = read_json_object(manifest_path, f"{engine_dir} has no {MANIFEST_NAME}").get("engine_config")
    if not isinstance(recorded, dict):
        raise DFlashTrtError(f"{manifest_path} records no engine_config (an engine from an older dflash-trt)")
    built = read_json_object(engine_dir / "config.json", f"{engine_dir} has no config.json")
    differences = config_differences(recorded, built)
    if differences:
        raise DFlashTrtError(
            f"the engine in {engine_dir} differs from what dflash-trt planned: " + "; ".join(differences)
        )


def built_max_seq_len(max_seq_len: int, draft_nodes: int, num_eagle_layers: int) -> int:
    """builder.build() adds max_draft_len (any speculative mode: the drafts verified per step, N for a draft tree)
    and num_eagle_layers (EAGLE: our K draft positions) to max_seq_len [read: builder.py `build`]."""
    return max_seq_len + draft_nodes + num_eagle_layers


def engine_max_seq_len(facts: CheckpointFacts, settings: EngineBuildSettings) -> int:
    """The engine's own max_seq_len (`built_max_seq_len`)."""
    return engine_lengths(facts, settings).engine_max_seq_len


def manifest(facts: CheckpointFacts, settings: EngineBuildSettings, plugin_library: str) -> dict[str, Any]:
    """`dflash_trt.json`: what runners and the Triton repository generator need beyond TensorRT-LLM's config.json."""
    k = facts.max_draft_len
    return {
        "format": MANIFEST_FORMAT,
        "dflash_trt_version": __version__,
        "tensorrt_llm_version": REQUIRED_TRTLLM,
        "base_architecture": facts.base_architecture,
        "speculative_decoding_mode": SPECULATIVE_DECODING_MODE,
        "block_size": facts.block_size,
        "max_draft_len": verified_drafts(facts, settings),
        "draft_tree": settings.draft_tree,
        "drafter": facts.drafter,
        # The chain over the draft positions (num_eagle_layers): a request's first paths, checked against the
        # layers [read]; a tree engine emits its own paths every step after that.
        "eagle_choices": chain_eagle_choices(k),
        "mask_token_id": facts.mask_token_id,
        "target_layer_ids": list(facts.target_layer_ids),
        "num_target_layers": facts.num_target_layers,
        "num_draft_layers": facts.num_draft_layers,
        "draft_kv_layer_offset": facts.num_target_layers,
        "sampling": SAMPLING_POLICY,
        "honoured_sampling_parameters": list(HONOURED),
        "plugin_library": plugin_library,
        "plugin_namespace": PLUGIN_NAMESPACE,
        "max_batch_size": settings.max_batch_size,
        "max_seq_len": engine_max_seq_len(facts, settings),
        "tp_size": facts.tp_size,
        "quant_algo": facts.quant_algo,
        "kv_cache_quant_algo": facts.kv_cache_quant_algo,
        "gpu": settings.gpu,
        "sm": settings.route.sm,
        "attention": settings.route.describe(facts.layer_types, tree=settings.draft_tree is not None),
        "draft_len_schedule": settings.draft_len_schedule.text(),
        "engine_config": engine_config(facts, settings),
    }


def check_network(facts: CheckpointFacts) -> None:
    """What the network of model.py cannot be built for, whatever the settings (the emulated engine applies these
    too)."""
    check_kv_geometry(facts)
    check_qk_norm_heads(facts)
    check_rope(facts)
    check_quantization(facts)
    check_moe_layers(facts)
    check_kv_cache_format(weights_qformat(facts), kv_cache_format(facts))


def plan_engine_build(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    settings: EngineBuildSettings,
    plugin_library: str | Path | None = None,
    require_weights: bool = True,
) -> EngineBuildPlan:
    """Validate a converted checkpoint against the build settings and return the exact build to run.

    Build profiles plan through here too (from the config.json the converter will write, `require_weights`
    False), so both ways into `build` apply the same checks.
    """
    facts = read_checkpoint_facts(checkpoint_dir)
    # A tree of the chain's node count is the chain: the plan records no tree for it.
    tree = verified_drafts(facts, settings)
    settings = replace(settings, draft_tree=tree if tree != facts.max_draft_len else None)
    if settings.draft_tree is not None:
        settings.route.check_tree(settings.gpu, settings.draft_tree)
    check_network(facts)
    check_xqa_block_layout(facts, settings)
    check_attention_route(facts, settings)
    check_settings(facts, settings)
    settings = resolve_settings(facts, settings)
    check_extra_flags(settings)
    if require_weights:
        check_rank_files(Path(checkpoint_dir), facts)
    library = str(Path(plugin_library if plugin_library is not None else default_library_path()).absolute())
    checkpoint, output = str(checkpoint_dir), str(output_dir)
    return EngineBuildPlan(
        checkpoint_dir=checkpoint,
        output_dir=output,
        command=build_command(checkpoint, output, verified_drafts(facts, settings), settings),
        build_config=build_config_dict(facts, settings),
        plugin_library=library,
        dflash_manifest=manifest(facts, settings, library),
        settings=settings,
        lengths=engine_lengths(facts, settings),
        world_size=facts.tp_size * facts.pp_size,
    )


def settings_dict(settings: EngineBuildSettings) -> dict[str, Any]:
    data = asdict(settings)
    data["extra_flags"] = list(settings.extra_flags)
    data["draft_len_schedule"] = settings.draft_len_schedule.text()
    return data
