"""Build profiles: one YAML file fixes everything needed to go from two HF checkpoints to a served engine.

The schema rejects unknown keys and impossible combinations up front (NVFP4 on Hopper, a draft chain longer than
the drafter's block, a batch the token budget cannot hold...), so a profile that loads is one the GPU host can
build. Facts that need the checkpoints themselves (head counts, block size) are checked by
`check_against_checkpoints` once the configs are on disk.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_trt.errors import DFlashTrtError
from dflash_trt.spec import QWEN3_MOE, parse_target_config


@dataclass(frozen=True)
class GpuFacts:
    """What the build may assume about one GPU model."""

    sm: int
    memory_gb: int
    fp8: bool
    nvfp4: bool


# SM90 Hopper has FP8 tensor cores but no FP4; SM100/SM103 Blackwell add NVFP4. A100 (SM80) is listed so that
# a profile written for it fails with a clear message instead of at engine build time.
GPUS: dict[str, GpuFacts] = {
    "a100": GpuFacts(sm=80, memory_gb=80, fp8=False, nvfp4=False),
    "h100": GpuFacts(sm=90, memory_gb=80, fp8=True, nvfp4=False),
    "h200": GpuFacts(sm=90, memory_gb=141, fp8=True, nvfp4=False),
    "b200": GpuFacts(sm=100, memory_gb=180, fp8=True, nvfp4=True),
    "b300": GpuFacts(sm=103, memory_gb=288, fp8=True, nvfp4=True),
}

# Bytes per weight: NVFP4 packs two values per byte plus one FP8 scale per 16 values; "none" keeps bf16/fp16.
BYTES_PER_WEIGHT = {"fp8": 1.0, "nvfp4": 0.5 + 1 / 16, "none": 2.0}
# Share of GPU memory the weights may take; the rest holds the KV pool (drafter layers included), activations
# and the CUDA context.
MAX_WEIGHT_SHARE = 0.8

# Limits of TensorRT-LLM 1.2.x's EAGLE engine path (builder asserts), which our engine speaks.
EAGLE_MAX_BATCH_SIZE = 512
EAGLE_MAX_DRAFT_LEN = 256

QFormat = Literal["fp8", "nvfp4", "none"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSources(_Strict):
    """Where the target and the drafter come from: HF ids (resolved in the local HF cache) or directories."""

    target: str
    draft: str
    target_revision: str | None = None
    draft_revision: str | None = None
    tokenizer: str | None = Field(default=None, description="defaults to the target")
    block_size: int = Field(ge=2, le=64, description="the drafter's trained block size, checked at build time")

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer or self.target


class CheckpointSettings(_Strict):
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    tp_size: int = Field(default=1, ge=1, le=8)

    @field_validator("tp_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"tp_size must be 1, 2, 4 or 8, got {v}")
        return v


class CalibrationSettings(_Strict):
    dataset: str = "calibration.jsonl"  # jsonl prompts ({"text": ...} per line), relative to the profile file
    size: int = Field(default=512, ge=1)
    max_seq_len: int = Field(default=1024, ge=16)


class QuantizationSettings(_Strict):
    qformat: QFormat
    draft_qformat: QFormat
    kv_cache_dtype: Literal["fp8", "none"]
    calibration: CalibrationSettings = CalibrationSettings()


class EngineSettings(_Strict):
    """The trtllm-build settings that matter for a DFlash engine; names follow trtllm-build's flags."""

    max_batch_size: int = Field(ge=1)
    max_input_len: int = Field(ge=1)
    max_seq_len: int = Field(ge=2)
    max_num_tokens: int = Field(ge=1)
    max_draft_len: int = Field(ge=1)
    gemm_plugin: Literal["auto", "fp8", "nvfp4", "bfloat16", "float16"]
    use_paged_context_fmha: bool = True
    use_fp8_context_fmha: bool = False
    multiple_profiles: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> EngineSettings:
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"max_input_len ({self.max_input_len}) must be below max_seq_len ({self.max_seq_len}) "
                "to leave room for generated tokens"
            )
        if self.max_batch_size > EAGLE_MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size {self.max_batch_size} exceeds the EAGLE engine limit of 512")
        if self.max_draft_len > EAGLE_MAX_DRAFT_LEN:
            raise ValueError(f"max_draft_len {self.max_draft_len} exceeds the EAGLE engine limit of 256")
        if not self.use_paged_context_fmha:
            raise ValueError("use_paged_context_fmha must stay true: EAGLE-mode engines require it")
        return self


class ServingSettings(_Strict):
    """Triton `tensorrtllm` backend knobs that are not part of the engine."""

    kv_cache_free_gpu_mem_fraction: float = Field(default=0.9, gt=0.0, lt=1.0)
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    enable_chunked_context: bool = True
    enable_kv_cache_reuse: bool = False
    max_queue_delay_microseconds: int = Field(default=0, ge=0)
    instance_count: int = Field(default=1, ge=1, description="pre/post-processing Python model instances")


class SweepSettings(_Strict):
    concurrency: list[int] = Field(min_length=1)
    interactivity_band: tuple[float, float] = Field(description="target output tokens/s per user: low, high")
    input_len: int = Field(default=1024, ge=1)
    output_len: int = Field(default=1024, ge=1)

    @field_validator("concurrency")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v) or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"concurrency must be positive and strictly increasing, got {v}")
        return v

    @field_validator("interactivity_band")
    @classmethod
    def _band(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 < v[0] < v[1]:
            raise ValueError(f"interactivity_band must be (low, high) with 0 < low < high, got {list(v)}")
        return v


class BuildProfile(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    gpu: Literal["a100", "h100", "h200", "b200", "b300"]
    model: ModelSources
    checkpoint: CheckpointSettings = CheckpointSettings()
    quantization: QuantizationSettings
    engine: EngineSettings
    serving: ServingSettings = ServingSettings()
    sweep: SweepSettings

    @property
    def gpu_facts(self) -> GpuFacts:
        return GPUS[self.gpu]

    @model_validator(mode="after")
    def _feasible(self) -> BuildProfile:
        gpu, q, eng = self.gpu_facts, self.quantization, self.engine
        block = self.model.block_size
        for what, fmt in (("qformat", q.qformat), ("draft_qformat", q.draft_qformat)):
            if fmt == "nvfp4" and not gpu.nvfp4:
                raise ValueError(f"{what} nvfp4 needs Blackwell (SM100/SM103); {self.gpu} is SM{gpu.sm}")
            if fmt == "fp8" and not gpu.fp8:
                raise ValueError(f"{what} fp8 needs SM89 or newer; {self.gpu} is SM{gpu.sm}")
        if q.draft_qformat != q.qformat:
            raise ValueError(
                f"draft_qformat {q.draft_qformat} differs from qformat {q.qformat}: one TensorRT-LLM engine applies "
                "one quantization to the target and the drafter"
            )
        if q.kv_cache_dtype == "fp8" and not gpu.fp8:
            raise ValueError(f"kv_cache_dtype fp8 needs SM89 or newer; {self.gpu} is SM{gpu.sm}")
        if eng.gemm_plugin == "nvfp4" and q.qformat != "nvfp4":
            raise ValueError("gemm_plugin nvfp4 needs qformat nvfp4")
        if eng.gemm_plugin == "fp8" and q.qformat != "fp8":
            raise ValueError("gemm_plugin fp8 needs qformat fp8")
        if eng.use_fp8_context_fmha and q.kv_cache_dtype != "fp8":
            raise ValueError("use_fp8_context_fmha needs kv_cache_dtype fp8")
        if eng.max_draft_len > block - 1:
            raise ValueError(
                f"max_draft_len {eng.max_draft_len} exceeds block_size - 1 = {block - 1}: the drafter "
                f"proposes at most {block - 1} tokens per block"
            )
        if eng.max_draft_len < block - 1:
            raise ValueError(
                f"max_draft_len {eng.max_draft_len} is below block_size - 1 = {block - 1}: the DFlash engine always "
                "drafts a full block"
            )
        if eng.max_num_tokens < eng.max_batch_size * block:
            raise ValueError(
                f"max_num_tokens {eng.max_num_tokens} is below max_batch_size x block_size = "
                f"{eng.max_batch_size * block}: a full batch of generation steps would not fit"
            )
        if self.checkpoint.dtype == "float16" and q.qformat == "nvfp4":
            raise ValueError("nvfp4 profiles use dtype bfloat16 (modelopt's NVFP4 export path)")
        if max(self.sweep.concurrency) > eng.max_batch_size:
            raise ValueError(
                f"sweep concurrency {max(self.sweep.concurrency)} exceeds max_batch_size {eng.max_batch_size}"
            )
        return self


def _format_validation_error(path: Path, exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{path}: {where + ': ' if where else ''}{message}{more}"


def parse_profile(data: object, source: Path | str = "<profile>") -> BuildProfile:
    """Validate a profile mapping; every failure becomes one DFlashTrtError naming the offending key."""
    if not isinstance(data, dict):
        raise DFlashTrtError(f"{source}: a build profile must be a YAML mapping")
    try:
        return BuildProfile.model_validate(data)
    except ValidationError as exc:
        raise DFlashTrtError(_format_validation_error(Path(source), exc)) from None


def load_profile(path: str | Path) -> BuildProfile:
    path = Path(path)
    if not path.is_file():
        raise DFlashTrtError(f"build profile {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DFlashTrtError(f"{path}: not valid YAML ({exc})") from None
    return parse_profile(data, path)


def default_hf_cache() -> Path:
    """The hub cache huggingface_hub itself would use, so already-downloaded models are found."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _looks_like_repo_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "~"))


def _snapshot_in_cache(repo_id: str, revision: str | None, cache_dir: Path) -> Path | None:
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref_file = repo_dir / "refs" / (revision or "main")
    if ref_file.is_file():
        candidate = snapshots / ref_file.read_text().strip()
        return candidate if candidate.is_dir() else None
    if revision is not None:
        candidate = snapshots / revision
        return candidate if candidate.is_dir() else None
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    return found[0] if len(found) == 1 else None


def resolve_model_dir(
    ref: str, *, revision: str | None = None, cache_dir: Path | None = None, allow_download: bool = False
) -> Path:
    """A local directory for `ref`: an existing path, else its HF-cache snapshot, else (only if allowed) a download."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if not _looks_like_repo_id(ref):
        raise DFlashTrtError(f"model directory {ref} does not exist")
    cache_dir = cache_dir or default_hf_cache()
    snapshot = _snapshot_in_cache(ref, revision, cache_dir)
    if snapshot is not None:
        return snapshot
    if not allow_download:
        raise DFlashTrtError(
            f"{ref}{'@' + revision if revision else ''} is not in the HF cache {cache_dir}; pass a local "
            "directory, point --hf_cache at the cache that holds it, or allow the download with --download"
        )
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(ref, revision=revision, cache_dir=str(cache_dir)))


def _read_config(model_dir: Path) -> dict:
    config = model_dir / "config.json"
    if not config.is_file():
        raise DFlashTrtError(f"{model_dir} has no config.json")
    return json.loads(config.read_text())


def _draft_value(cfg: dict, key: str):
    nested = cfg.get("dflash_config") or {}
    return nested[key] if key in nested else cfg.get(key)


def _check_heads(who: str, heads: int, kv_heads: int, tp: int) -> None:
    if heads % tp:
        raise DFlashTrtError(f"tp_size {tp} does not divide the {who}'s {heads} attention heads")
    if kv_heads % tp and tp % kv_heads:
        raise DFlashTrtError(
            f"tp_size {tp} and the {who}'s {kv_heads} KV heads are incompatible: one must divide the other"
        )


def _linear_weights(cfg: dict) -> int:
    """Weights of the decoder layers' linears (attention + gated MLP; every expert of a MoE target: all are held)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, head_dim = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or hidden // heads
    attention = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden
    mlps = cfg["num_hidden_layers"] * 3 * hidden * cfg["intermediate_size"]
    if (cfg.get("architectures") or [None])[0] == QWEN3_MOE:
        moe = parse_target_config(cfg).moe
        sparse = len(moe.sparse_layers)
        mlps += sparse * 3 * hidden * (moe.num_experts * moe.intermediate_size - cfg["intermediate_size"])
    return cfg["num_hidden_layers"] * attention + mlps


def weight_gb_per_gpu(profile: BuildProfile, target: dict, draft: dict) -> float:
    """Weights one GPU holds: embeddings and lm_head stay in the checkpoint dtype, linears in the profile's format."""
    hidden = target["hidden_size"]
    embeddings = target["vocab_size"] * hidden * (1 if target.get("tie_word_embeddings") else 2)
    taps = len(_draft_value(draft, "target_layer_ids") or range(draft["num_hidden_layers"]))
    linears = _linear_weights(target) + _linear_weights(draft) + taps * hidden * hidden
    total = embeddings * BYTES_PER_WEIGHT["none"] + linears * BYTES_PER_WEIGHT[profile.quantization.qformat]
    return total / profile.checkpoint.tp_size / 1e9


def check_against_checkpoints(profile: BuildProfile, target_dir: Path, draft_dir: Path) -> None:
    """Checks that need the real configs: TP against head counts, block size, sequence length, memory."""
    target, draft = _read_config(target_dir), _read_config(draft_dir)
    tp = profile.checkpoint.tp_size
    heads = target["num_attention_heads"]
    _check_heads("target", heads, target.get("num_key_value_heads", heads), tp)
    d_heads = draft["num_attention_heads"]
    _check_heads("drafter", d_heads, draft.get("num_key_value_heads", d_heads), tp)
    block = _draft_value(draft, "block_size")
    if block is not None and block != profile.model.block_size:
        raise DFlashTrtError(
            f"profile {profile.name} was sized for block_size {profile.model.block_size} but "
            f"{draft_dir} was trained with block_size {block}"
        )
    need, memory = weight_gb_per_gpu(profile, target, draft), profile.gpu_facts.memory_gb
    if need > MAX_WEIGHT_SHARE * memory:
        raise DFlashTrtError(
            f"the weights need about {need:.0f} GB per GPU but {profile.gpu} has {memory} GB, of which at most "
            f"{MAX_WEIGHT_SHARE:.0%} may hold weights (the KV cache needs the rest); raise tp_size or quantize"
        )
    max_pos = target.get("max_position_embeddings")
    if max_pos is not None and profile.engine.max_seq_len > max_pos:
        raise DFlashTrtError(
            f"max_seq_len {profile.engine.max_seq_len} exceeds the target's max_position_embeddings {max_pos}"
        )
