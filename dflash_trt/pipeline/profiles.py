"""Build profiles: one YAML file fixes everything needed to go from two HF checkpoints to a served engine.

The schema rejects unknown keys and impossible combinations up front (NVFP4 on Hopper, a draft chain longer than
the drafter's block, a batch the token budget cannot hold...), so a profile that loads is one the GPU host can
build. Facts that need the checkpoints themselves (head counts, block size) are checked by
`check_against_configs` once the configs are known.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_trt.analysis.gpus import GPUS, GpuSpec
from dflash_trt.analysis.memory import weights_per_gpu
from dflash_trt.analysis.model import PRECISION
from dflash_trt.analysis.shapes import dflash_from_spec, target_from_spec
from dflash_trt.checkpoint.sharding import check_parallel
from dflash_trt.checkpoint.stored import QuantSettings
from dflash_trt.draft_schedule import AUTO, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import ENGINE_DTYPES, KV_CACHE_DTYPES, NVFP4, QFORMATS
from dflash_trt.gpu_targets import check_nvfp4_gpu, gpu_sm
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE
from dflash_trt.recorded_configs import PACKAGED_RECORDED_CONFIGS
from dflash_trt.spec import DraftSpec, TargetSpec, load_draft_spec, load_target_spec
from dflash_trt.triton.serving import ServingSettings
from dflash_trt.trtllm.attention_route import AttentionRoute
from dflash_trt.trtllm.build_limits import GEMM_PLUGIN_CHOICES, MAX_EAGLE_DRAFT_LEN, TOKENS_PER_BLOCK
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.eagle_layout import check_tree_nodes
from dflash_trt.trtllm.network_checks import check_kv_cache_format
from dflash_trt.trtllm.settings_checks import check_engine_settings, check_fp8_context_fmha, resolved_gemm_plugin
from dflash_trt.yamlfile import safe_load_unique

# Share of GPU memory the weights may take; the rest holds the KV pool (drafter layers included), activations
# and the CUDA context.
MAX_WEIGHT_SHARE = 0.8


def _one_of(choices: Sequence[str]) -> AfterValidator:
    """A field validator for a vocabulary defined elsewhere (formats, build_limits, analysis.gpus): spelled once."""

    def check(value: str) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    return AfterValidator(check)


QFormat = Annotated[str, _one_of(QFORMATS)]
KvCacheDtype = Annotated[str, _one_of(KV_CACHE_DTYPES)]
EngineDtype = Annotated[str, _one_of(ENGINE_DTYPES)]
GemmPlugin = Annotated[str, _one_of(GEMM_PLUGIN_CHOICES)]
GpuName = Annotated[str, _one_of(tuple(GPUS))]


def _schedule_text(value: str) -> str:
    """`auto`, `none` or a table, checked by the one rule for it (inputs.py) and kept in its canonical spelling."""
    try:
        choice = DRAFT_LEN_SCHEDULE.check(value, "draft_len_schedule")
    except DFlashTrtError as exc:
        raise ValueError(str(exc).removeprefix("draft_len_schedule ")) from None
    return choice.text() if isinstance(choice, DraftLenSchedule) else AUTO


ScheduleText = Annotated[str, AfterValidator(_schedule_text)]


class _Strict(BaseModel):
    # strict: `max_batch_size: true` is not 1 and `use_fp8_context_fmha: "false"` is not true
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSources(_Strict):
    """Where the target and the drafter come from: HF ids (resolved in the local HF cache) or directories."""

    target: str
    draft: str
    target_revision: str | None = None
    draft_revision: str | None = None
    tokenizer: str | None = Field(default=None, description="defaults to the target")
    block_size: int = Field(ge=2, le=64, description="the drafter's trained block size, checked at build time")
    recorded_configs: str | None = Field(
        default=None,
        description="YAML of config.json fields per HF id, for dry runs without the models; relative to the profile. "
        "Omitted: the file shipped with the package; null: none",
    )

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer or self.target


class CheckpointSettings(_Strict):
    dtype: EngineDtype = "bfloat16"
    tp_size: int = Field(default=1, ge=1, le=8)

    @field_validator("tp_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"tp_size must be 1, 2, 4 or 8, got {v}")
        return v


class CalibrationSettings(_Strict):
    # jsonl prompts ({"text": ...} per line) or a local HF `datasets` folder, relative to the profile file
    dataset: str = "calibration.jsonl"
    size: int = Field(default=512, ge=1)
    max_seq_len: int = Field(default=1024, ge=16)


class QuantizationSection(_Strict):
    """The profile's `quantization` section: the formats as the converter takes them, and the calibration set."""

    qformat: QFormat
    dflash_qformat: QFormat
    kv_cache_dtype: KvCacheDtype
    calibration: CalibrationSettings = CalibrationSettings()

    @property
    def formats(self) -> QuantSettings:
        return QuantSettings(self.qformat, self.dflash_qformat, self.kv_cache_dtype)


class EngineSettings(_Strict):
    """The trtllm-build settings that matter for a DFlash engine; names follow trtllm-build's flags."""

    max_batch_size: int = Field(ge=1)
    max_input_len: int = Field(ge=1)
    max_seq_len: int = Field(ge=2)
    max_num_tokens: int = Field(ge=1)
    max_draft_len: int = Field(ge=1)
    gemm_plugin: GemmPlugin
    use_paged_context_fmha: bool = EngineBuildSettings.use_paged_context_fmha
    # Unset: what TensorRT-LLM 1.2.x's builder settles on (on for fp8/nvfp4 weights with an FP8 KV cache).
    use_fp8_context_fmha: bool | None = EngineBuildSettings.use_fp8_context_fmha
    multiple_profiles: bool = EngineBuildSettings.multiple_profiles
    draft_len_schedule: ScheduleText = Field(
        default=AUTO,
        description="drafts per request by the step's load: auto (derived for this GPU, TP and quantization), none "
        "or N1:K1,N2:K2,... (docs/performance.md)",
    )
    draft_tree: int | None = Field(
        default=None,
        ge=1,
        description="nodes of the draft tree each request verifies per step (`dflash-trt build --draft_tree`); unset "
        "or max_draft_len: the chain",
    )

    @property
    def schedule_choice(self) -> DraftLenSchedule | str:
        """`AUTO`, or the table as a schedule."""
        choice = DRAFT_LEN_SCHEDULE.check(self.draft_len_schedule, "engine.draft_len_schedule")
        assert choice == AUTO or isinstance(choice, DraftLenSchedule)
        return choice

    def build_settings(self) -> EngineBuildSettings:
        """The section as build settings: every field both spell the same way (trtllm-build's flag names);
        `max_draft_len` is not among them, the build takes it from the checkpoint's block size, nor the draft-length
        schedule, which `pipeline/schedule.py` resolves from the models (auto needs their shapes)."""
        shared = {f.name for f in dataclasses.fields(EngineBuildSettings)} - {"draft_len_schedule"}
        return EngineBuildSettings(**self.model_dump(include=shared))

    @model_validator(mode="after")
    def _consistent(self) -> EngineSettings:
        """The build's own rules on these settings (one place for profiles and `build` flags), and the EAGLE
        limit on the draft length the build would take from the checkpoint."""
        try:
            check_engine_settings(self.build_settings())
        except DFlashTrtError as exc:
            raise ValueError(str(exc)) from None
        if self.max_draft_len > MAX_EAGLE_DRAFT_LEN:
            raise ValueError(
                f"max_draft_len {self.max_draft_len} exceeds the EAGLE engine limit of {MAX_EAGLE_DRAFT_LEN}"
            )
        return self


class SweepSettings(_Strict):
    concurrency: list[int] = Field(min_length=1)
    interactivity_band: tuple[float, float] = Field(
        strict=False, description="target output tokens/s per user: low, high"
    )
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


def _beside(profile_path: str | Path, value: str) -> Path:
    """A path named in a profile: relative ones are relative to the profile file."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path(profile_path).parent / path


class BuildProfile(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    gpu: GpuName
    model: ModelSources
    checkpoint: CheckpointSettings = CheckpointSettings()
    quantization: QuantizationSection
    engine: EngineSettings
    serving: ServingSettings = ServingSettings()
    sweep: SweepSettings

    @property
    def gpu_facts(self) -> GpuSpec:
        return GPUS[self.gpu]

    @property
    def quantizes(self) -> bool:
        """Whether the checkpoint stage quantizes (and so calibrates)."""
        q = self.quantization
        return (q.qformat, q.dflash_qformat, q.kv_cache_dtype) != ("none", "none", "none")

    def calibration_dataset(self, profile_path: str | Path) -> Path | None:
        """The calibration prompts (a path relative to the profile file is resolved there), None if not quantizing."""
        if not self.quantizes:
            return None
        return _beside(profile_path, self.quantization.calibration.dataset)

    def recorded_configs_path(self, profile_path: str | Path) -> Path | None:
        """The profile's recorded configs; a profile that does not name any uses the ones shipped with the package."""
        if "recorded_configs" not in self.model.model_fields_set:
            return PACKAGED_RECORDED_CONFIGS
        return None if self.model.recorded_configs is None else _beside(profile_path, self.model.recorded_configs)

    @model_validator(mode="after")
    def _feasible(self) -> BuildProfile:
        q, eng = self.quantization, self.engine
        block = self.model.block_size
        for what, fmt in (("qformat", q.qformat), ("dflash_qformat", q.dflash_qformat)):
            if fmt == NVFP4:
                try:
                    check_nvfp4_gpu(self.gpu, what)
                except DFlashTrtError as exc:
                    raise ValueError(str(exc)) from None
        if q.dflash_qformat != q.qformat:
            raise ValueError(
                f"dflash_qformat {q.dflash_qformat} differs from qformat {q.qformat}: one TensorRT-LLM engine applies "
                "one quantization to the target and the drafter"
            )
        try:
            resolved_gemm_plugin(eng.gemm_plugin, q.qformat)
            check_kv_cache_format(q.qformat, q.kv_cache_dtype)
            check_fp8_context_fmha(eng.use_fp8_context_fmha, q.qformat, q.kv_cache_dtype)
        except DFlashTrtError as exc:
            raise ValueError(str(exc)) from None
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
        try:
            tree = profile_tree(self.gpu, eng.draft_tree, block - 1, "engine.draft_tree")
        except DFlashTrtError as exc:
            raise ValueError(str(exc)) from None
        if isinstance(eng.schedule_choice, DraftLenSchedule):
            try:
                eng.schedule_choice.fitted_to(tree or block - 1, "engine.draft_len_schedule")
            except DFlashTrtError as exc:
                raise ValueError(str(exc)) from None
        # A full batch of generation steps verifies max_batch_size x block_size tokens (a draft tree's nodes + 1
        # per request); the step must still carry one prefill chunk, or no new request could ever start while the
        # batch is full. Without chunked context the whole prompt (up to max_input_len) is that chunk.
        chunked = self.serving.enable_chunked_context
        chunk = TOKENS_PER_BLOCK if chunked else eng.max_input_len
        verified = block if tree is None else tree + 1
        need = eng.max_batch_size * verified + chunk
        if eng.max_num_tokens < need:
            what = f"one {TOKENS_PER_BLOCK}-token context chunk" if chunked else f"one max_input_len prompt ({chunk})"
            width = "block_size" if tree is None else "(draft_tree + 1)"
            raise ValueError(
                f"max_num_tokens {eng.max_num_tokens} is below max_batch_size x {width} + {what} = {need}: "
                "a full batch of generation steps would leave no room for prefill"
            )
        if max(self.sweep.concurrency) > eng.max_batch_size:
            raise ValueError(
                f"sweep concurrency {max(self.sweep.concurrency)} exceeds max_batch_size {eng.max_batch_size}"
            )
        return self


def profile_tree(gpu: str, nodes: int | None, num_drafts: int, what: str) -> int | None:
    """A profile's draft tree (`engine.draft_tree`, or `build --config --draft_tree` over it) by the build's rules
    that need no model: the node rule (`check_tree_nodes`) and the GPU's attention route; None for the chain. The
    engine plan checks the rest once the models are known (a DFlash2 drafter, the resolved draft-length schedule)."""
    tree = check_tree_nodes(nodes, num_drafts, dflash2=False, what=what)
    if tree:
        AttentionRoute(gpu_sm(gpu)).check_tree(gpu, tree)
    return tree or None


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
        data = safe_load_unique(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise DFlashTrtError(f"{path}: not valid YAML ({exc})") from None
    except RecursionError:
        raise DFlashTrtError(f"{path}: nested too deeply to be a build profile") from None
    profile = parse_profile(data, path)
    dataset = profile.calibration_dataset(path)
    if dataset is not None and not dataset.exists():
        raise DFlashTrtError(f"{path}: quantization.calibration.dataset: {dataset} does not exist")
    return profile


def default_hf_cache() -> Path:
    """The hub cache huggingface_hub itself would use, so already-downloaded models are found."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def looks_like_repo_id(ref: str) -> bool:
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
    if path.exists():
        raise DFlashTrtError(f"model directory {ref} is a file, not a directory")
    if not looks_like_repo_id(ref):
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


def weight_bytes_per_gpu(profile: BuildProfile, target: TargetSpec, draft: DraftSpec) -> float:
    """Weights one GPU of the profile holds (`analysis.memory`'s formula, every expert included)."""
    precision = PRECISION[profile.quantization.qformat]
    return weights_per_gpu(target_from_spec(target), dflash_from_spec(draft), precision, profile.checkpoint.tp_size)


def check_against_configs(profile: BuildProfile, target: TargetSpec, draft: DraftSpec, draft_name: str) -> None:
    """Checks that need the models' shapes: TP against their heads and MLPs, block size, memory. Everything the
    engine build checks (sequence length, GEMM plugin, ...) runs when the pipeline plans the build, for profiles and
    `--checkpoint_dir` alike."""
    check_parallel(target, draft, profile.checkpoint.tp_size, moe_ep_size=1)
    if draft.block_size != profile.model.block_size:
        raise DFlashTrtError(
            f"profile {profile.name} was sized for block_size {profile.model.block_size} but "
            f"{draft_name} was trained with block_size {draft.block_size}"
        )
    need, memory = weight_bytes_per_gpu(profile, target, draft) / 1e9, profile.gpu_facts.hbm_bytes / 1e9
    if need > MAX_WEIGHT_SHARE * memory:
        raise DFlashTrtError(
            f"the weights need about {need:.0f} GB per GPU but {profile.gpu} has {memory:.0f} GB, of which at most "
            f"{MAX_WEIGHT_SHARE:.0%} may hold weights (the KV cache needs the rest); raise tp_size or quantize"
        )


def check_against_checkpoints(profile: BuildProfile, target_dir: Path, draft_dir: Path) -> None:
    target = load_target_spec(target_dir)
    check_against_configs(profile, target, load_draft_spec(draft_dir, target), str(draft_dir))
