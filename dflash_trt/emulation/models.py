"""The stand-in `tensorrt_llm.models` pieces: Mapping, PretrainedConfig + QWenConfig / LLaMAConfig, the stock
QWenDecoderLayer (Qwen3 and Qwen3-MoE branches) and LLaMADecoderLayer, PretrainedModel's construction /
checkpoint loading and DecoderModelForCausalLM, following 1.2.x models/{modeling_utils, qwen/{config,model},
llama/{config,model}}.py. QWenConfig turns its `moe` dict into a `MoeConfig` (qwen/config.py); QWenDecoderLayer
gives every layer a `MOE` of `moe_intermediate_size` once `moe.has_moe()` (qwen/model.py) [read, not run].

Faithful details that matter to our network: QWenDecoderLayer builds its q/k RmsNorm through `Attention(...,
qk_layernorm=True, layernorm_type=RmsNorm)` without `eps`, so they get Attention's default 1e-5, and passes
`dense_bias=False`; LLaMADecoderLayer's dense bias follows `attn_bias`. Construction runs `__post_init__` after
`__init__` (PostInitCaller), which quantizes the linears. `from_checkpoint` reads `config.json` through
`MODEL_MAP[architecture]`, applies `preprocess_weights` (kv_cache_rcp_scaling_factor, NVFP4 renames, FP8 lm_head
scale drop) and `load`: a missing tensor or a misshaped one raises, an extra one is only warned about, as in 1.2.x.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from dflash_trt.checkpoint.safetensors_io import SafetensorsFile
from dflash_trt.emulation.functional import AttentionMaskType, EmulationError, LayerNormType
from dflash_trt.emulation.layers import Attention, GatedMLP, Linear, RmsNorm
from dflash_trt.emulation.module import Module, Parameter
from dflash_trt.emulation.moe import MOE, MoeConfig
from dflash_trt.emulation.quantization import FP8, NVFP4, QuantConfig
from dflash_trt.reference.quantized import reciprocal_input_scale

MODEL_MAP: dict[str, type] = {}


class Mapping:
    """1.2.x `mapping.py` for tensor (and expert) parallelism without pipeline stages: rank r is tp rank r; of the
    MoE split `tp = moe_tp * moe_ep`, rank r holds expert group `r % moe_ep` and slice `r // moe_ep` of each expert
    (moe_ep_rank / moe_tp_rank)."""

    def __init__(
        self,
        world_size: int = 1,
        rank: int = 0,
        tp_size: int = 1,
        pp_size: int = 1,
        moe_tp_size: int = -1,
        moe_ep_size: int = -1,
        **unused: Any,
    ):
        if pp_size != 1:
            raise EmulationError("the emulation runs tensor-parallel ranks only (pp_size 1)")
        if world_size != tp_size * pp_size:
            raise EmulationError(f"world_size {world_size} != tp_size {tp_size} * pp_size {pp_size}")
        if not 0 <= rank < world_size:
            raise EmulationError(f"rank {rank} outside world_size {world_size}")
        if moe_tp_size == -1 and moe_ep_size == -1:
            moe_tp_size, moe_ep_size = tp_size, 1
        elif moe_tp_size == -1:
            moe_tp_size = tp_size // moe_ep_size
        elif moe_ep_size == -1:
            moe_ep_size = tp_size // moe_tp_size
        if moe_tp_size * moe_ep_size != tp_size:
            raise EmulationError(f"moe_tp_size {moe_tp_size} * moe_ep_size {moe_ep_size} != tp_size {tp_size}")
        self.world_size, self.rank, self.tp_size, self.pp_size = world_size, rank, tp_size, pp_size
        self.moe_tp_size, self.moe_ep_size = moe_tp_size, moe_ep_size
        self.tp_rank = rank % tp_size
        self.moe_tp_rank = self.tp_rank // moe_ep_size
        self.moe_ep_rank = self.tp_rank % moe_ep_size
        self.tp_group = list(range(tp_size))

    def to_dict(self) -> dict[str, int]:
        return {
            "world_size": self.world_size,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "moe_tp_size": self.moe_tp_size,
            "moe_ep_size": self.moe_ep_size,
        }


class PretrainedConfig:
    def __init__(
        self,
        *,
        architecture: str,
        dtype: str,
        hidden_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        vocab_size: int | None = None,
        hidden_act: str = "gelu",
        logits_dtype: str = "float32",
        norm_epsilon: float = 1e-5,
        position_embedding_type: str = "learned_absolute",
        max_position_embeddings: int | None = None,
        rotary_embedding_dim: int | None = None,
        num_key_value_heads: int | None = None,
        intermediate_size: int | None = None,
        mapping: Any = None,
        quantization: Any = None,
        use_parallel_embedding: bool = False,
        embedding_sharding_dim: int = 0,
        head_size: int | None = None,
        qk_layernorm: bool = False,
        runtime_defaults: Any = None,
        **kwargs: Any,
    ):
        self.architecture = architecture
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.vocab_size = vocab_size
        self.hidden_act = hidden_act
        self.logits_dtype = logits_dtype
        self.norm_epsilon = norm_epsilon
        self.position_embedding_type = position_embedding_type
        self.max_position_embeddings = max_position_embeddings
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size
        self.head_size = head_size or hidden_size // num_attention_heads
        self.rotary_embedding_dim = rotary_embedding_dim
        self.qk_layernorm = qk_layernorm
        self.use_parallel_embedding = use_parallel_embedding
        self.embedding_sharding_dim = embedding_sharding_dim
        self.runtime_defaults = runtime_defaults
        self.mapping = mapping if isinstance(mapping, Mapping) else Mapping(**(mapping or {}))
        self.quantization = (
            quantization if isinstance(quantization, QuantConfig) else QuantConfig.from_dict(quantization)
        )
        for key, value in kwargs.items():
            setattr(self, key, value)

    @property
    def quant_mode(self) -> Any:
        return self.quantization.quant_mode

    def to_dict(self) -> dict[str, Any]:
        output = copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("mapping", "quantization")})
        output["mapping"] = self.mapping.to_dict()
        output["quantization"] = self.quantization.to_dict()
        return output

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> PretrainedConfig:
        return cls(**copy.deepcopy(config))

    def set_rank(self, rank: int) -> None:
        self.mapping = Mapping(**{**self.mapping.to_dict(), "rank": rank})


class QWenConfig(PretrainedConfig):
    def __init__(
        self,
        *,
        mlp_bias: bool = False,
        attn_bias: bool = True,
        rotary_base: float = 10000.0,
        rotary_scaling: dict | None = None,
        disable_weight_only_quant_plugin: bool = False,
        use_logn_attn: bool = False,
        moe: Any = None,
        num_labels: int = 1,
        mlp_only_layers: Any = None,
        decoder_sparse_step: int = 1,
        **kwargs: Any,
    ):
        self.mlp_bias, self.attn_bias = mlp_bias, attn_bias
        self.rotary_base, self.rotary_scaling = rotary_base, rotary_scaling
        self.mlp_only_layers, self.decoder_sparse_step = mlp_only_layers or [], decoder_sparse_step
        if moe is None:
            moe = MoeConfig(
                num_experts=kwargs.pop("moe_num_experts", 0),
                top_k=kwargs.pop("moe_top_k", 0),
                normalization_mode=kwargs.pop("moe_normalization_mode", MoeConfig.ExpertScaleNormalizationMode.NONE),
            )
        elif isinstance(moe, dict):
            moe = MoeConfig.from_dict(moe)
        self.moe = moe.validate()
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["moe"] = self.moe.to_dict()
        return output


class LLaMAConfig(PretrainedConfig):
    def __init__(
        self,
        *,
        mlp_bias: bool = False,
        attn_bias: bool = False,
        rotary_base: float = 10000.0,
        rotary_scaling: dict | None = None,
        residual_mlp: bool = False,
        disable_weight_only_quant_plugin: bool = False,
        moe: Any = None,
        remove_duplicated_kv_heads: bool = False,
        embedding_multiplier: float = 1.0,
        attention_multiplier: float = 1.0,
        residual_multiplier: float = 1.0,
        output_multiplier_scale: float = 1.0,
        **kwargs: Any,
    ):
        self.mlp_bias, self.attn_bias = mlp_bias, attn_bias
        self.rotary_base, self.rotary_scaling = rotary_base, rotary_scaling
        if moe or residual_mlp or (embedding_multiplier, attention_multiplier, residual_multiplier) != (1, 1, 1):
            raise EmulationError("the emulation builds plain Llama decoder layers")
        super().__init__(**kwargs)


def _residual_block(
    layer: Any,
    hidden_states: Any,
    use_cache: bool,
    spec_decoding_params: Any,
    kv_cache_params: Any,
    attention_params: Any,
) -> Any:
    """`residual + attention(input_layernorm(x))`, then `residual + mlp(post_layernorm(x))` (both layers' forward)."""
    residual = hidden_states
    attention_output = layer.attention(
        layer.input_layernorm(hidden_states),
        use_cache=use_cache,
        spec_decoding_params=spec_decoding_params,
        kv_cache_params=kv_cache_params,
        attention_params=attention_params,
    )
    if use_cache:
        attention_output, presents = attention_output
    hidden_states = residual + attention_output
    hidden_states = hidden_states + layer.mlp(layer.post_layernorm(hidden_states))
    return (hidden_states, presents) if use_cache else hidden_states


def _stock_attention(config: Any, layer_idx: int, **extra: Any) -> Attention:
    """The attention both stock decoder layers build (qwen/model.py, llama/model.py); Qwen3 adds its q/k norm."""
    return Attention(
        local_layer_idx=layer_idx,
        hidden_size=config.hidden_size,
        attention_head_size=config.head_size,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings or 1024,
        dtype=config.dtype,
        attention_mask_type=AttentionMaskType.causal,
        bias=config.attn_bias,
        position_embedding_type=config.position_embedding_type,
        rotary_embedding_base=config.rotary_base,
        rotary_embedding_scaling=config.rotary_scaling,
        tp_group=config.mapping.tp_group,
        tp_size=config.mapping.tp_size,
        tp_rank=config.mapping.tp_rank,
        quant_mode=config.quant_mode,
        **extra,
    )


def _stock_mlp_kwargs(config: Any) -> dict[str, Any]:
    """The MLP arguments both stock decoder layers pass, whatever the MLP class and width."""
    return {
        "hidden_size": config.hidden_size,
        "hidden_act": config.hidden_act,
        "dtype": config.dtype,
        "bias": config.mlp_bias,
        "tp_group": config.mapping.tp_group,
        "tp_size": config.mapping.tp_size,
        "quant_mode": config.quant_mode,
    }


class QWenDecoderLayer(Module):
    def __init__(self, config: QWenConfig, layer_idx: int):
        super().__init__()
        qwen_type = getattr(config, "qwen_type", None)
        if qwen_type not in ("qwen3", "qwen3_moe"):
            raise EmulationError("the emulation builds the Qwen3 and Qwen3-MoE branches of QWenDecoderLayer")
        self.layer_idx = layer_idx
        self.config = config
        self.input_layernorm = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)
        self.attention = _stock_attention(
            config, layer_idx, dense_bias=False, qk_layernorm=True, layernorm_type=LayerNormType.RmsNorm
        )
        # Every layer gets the MoE MLP once the config has experts (mlp_only_layers is not read), sized by
        # moe_intermediate_size for qwen3_moe.
        mlp_cls: Any = GatedMLP
        mlp_kwargs: dict[str, Any] = {}
        inter = config.intermediate_size or 4 * config.hidden_size
        if config.moe.has_moe():
            mlp_cls, mlp_kwargs = MOE, {"moe_config": config.moe, "mapping": config.mapping}
            if qwen_type == "qwen3_moe":
                inter = getattr(config, "moe_intermediate_size")  # noqa: B009 (a kwargs field of the config)
        self.mlp = mlp_cls(ffn_hidden_size=inter, **_stock_mlp_kwargs(config), **mlp_kwargs)
        self.post_layernorm = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)

    def forward(
        self,
        hidden_states: Any,
        attention_mask: Any = None,
        use_cache: bool = False,
        spec_decoding_params: Any = None,
        kv_cache_params: Any = None,
        attention_params: Any = None,
        lora_layer_params: Any = None,
    ) -> Any:
        return _residual_block(self, hidden_states, use_cache, spec_decoding_params, kv_cache_params, attention_params)


class LLaMADecoderLayer(Module):
    def __init__(self, config: LLaMAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.input_layernorm = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)
        self.attention = _stock_attention(config, layer_idx)
        self.mlp = GatedMLP(
            ffn_hidden_size=config.intermediate_size or 4 * config.hidden_size, **_stock_mlp_kwargs(config)
        )
        self.post_layernorm = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)

    def forward(
        self,
        hidden_states: Any,
        attention_mask: Any = None,
        use_cache: bool = False,
        spec_decoding_params: Any = None,
        kv_cache_params: Any = None,
        attention_params: Any = None,
        lora_layer_params: Any = None,
        next_layer_input_layernorm_args: Any = None,
    ) -> Any:
        return _residual_block(self, hidden_states, use_cache, spec_decoding_params, kv_cache_params, attention_params)


class _PostInitCaller(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = type.__call__(cls, *args, **kwargs)
        obj.__post_init__()
        return obj


def quantize(model: Module, config: QuantConfig) -> None:
    """The module swap 1.2.x's `PretrainedModel.__post_init__` performs: every ColumnLinear/RowLinear whose dotted
    name no `exclude_modules` pattern matches (fnmatch) takes the parameters of FP8Linear / FP4Linear
    (quantization/layers.py); their GEMMs are executed by `Linear.forward`."""
    if config.quant_algo is None:
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude_modules):
            module.quantize_as(config.quant_algo)


def set_fp8_context_fhma(model: Module) -> None:
    """What the builder's `optimize_model` does when `use_fp8_context_fmha` is on [read: models/modeling_utils.py
    `set_fp8_context_fhma`]: each Attention whose dense layer is FP8 / NVFP4 gets `attention_output_orig_quant_scale`,
    the reciprocal of the dense's input scale, which `Attention.forward` hands the plugin for its FP8 output."""
    for _, layer in model.named_modules():
        if isinstance(layer, Attention) and layer.dense.quant_algo is not None:
            dense = layer.dense
            scale = (
                dense.activation_scaling_factor if dense.quant_algo == FP8 else dense.activation_global_scaling_factor
            )
            layer.attention_output_orig_quant_scale = Parameter(reciprocal_input_scale(scale.raw), dtype="float32")


class PretrainedModel(Module, metaclass=_PostInitCaller):
    config_class = PretrainedConfig

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config

    def __post_init__(self) -> None:
        quantize(self, self.config.quantization)

    @classmethod
    def from_checkpoint(
        cls, ckpt_dir: str | Path, rank: int = 0, config: PretrainedConfig | None = None
    ) -> PretrainedModel:
        """As 1.2.x: the config read from the directory unless given (trtllm-build's `build_model` passes one)."""
        ckpt_dir = Path(ckpt_dir)
        if config is None:
            raw = json.loads((ckpt_dir / "config.json").read_text())
            model_cls: Any = MODEL_MAP[raw["architecture"]]
            config = model_cls.config_class.from_dict(raw)
        config.set_rank(rank)
        reader = SafetensorsFile(ckpt_dir / f"rank{rank}.safetensors")
        try:
            weights = {name: reader.get(name, copy=True) for name in reader.names()}
        finally:
            reader.close()
        weights = preprocess_weights(weights, config)
        model = cls(config)
        model.load(weights)
        return model

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Strict by name and shape; names provided but not required are warned about and kept in `unused_tensors`
        (1.2.x only logs them)."""
        required = set()
        for name, param in self.named_parameters():
            if param.is_inited():
                continue
            if (
                name not in weights
                and name.endswith("lm_head.weight")
                and any(k.endswith("vocab_embedding.weight") for k in weights)
            ):
                continue
            required.add(name)
        provided = set(weights)
        if not required <= provided:
            raise EmulationError(f"Required but not provided tensors:{sorted(required - provided)}")
        self.unused_tensors = sorted(provided - required)
        if self.unused_tensors:
            warnings.warn(f"Provided but not required tensors: {self.unused_tensors}", stacklevel=2)
        for name, param in self.named_parameters():
            if name in provided:
                try:
                    param.value = weights[name]
                except EmulationError as exc:
                    raise EmulationError(f"Encounter error '{exc}' for parameter '{name}'") from None


def preprocess_weights(weights: dict[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """modeling_utils.py `preprocess_weights` for the algorithms the emulation runs."""
    for name in list(weights):
        if name.endswith(".kv_cache_scaling_factor"):
            rcp = name.replace("kv_cache_scaling_factor", "kv_cache_rcp_scaling_factor")
            weights.setdefault(rcp, torch.reciprocal(weights[name]))
    algo = config.quantization.quant_algo
    if algo == FP8:
        head = weights.get("lm_head.weight")
        if head is not None and head.dtype != torch.float8_e4m3fn:
            weights.pop("lm_head.weights_scaling_factor", None)
            weights.pop("lm_head.activation_scaling_factor", None)
    elif algo == NVFP4:
        for name in list(weights):
            if name.endswith("weights_scaling_factor"):
                out, cols = weights[name].shape
                block = name.replace("weights_scaling_factor", "weights_block_scaling_factor")
                weights[block] = weights.pop(name)
                # The interleaved copy feeds the nvfp4 GEMM plugin's swizzled layout; the emulated GEMM reads the
                # linear one, so the copy only has to have the padded shape strict loading checks.
                padded = torch.zeros(-(-out // 128) * 128, -(-cols // 4) * 4, dtype=weights[block].dtype)
                padded[:out, :cols] = weights[block]
                weights[block + "_interleaved"] = padded
            elif name.endswith("weights_scaling_factor_2"):
                weights[name.replace("weights_scaling_factor_2", "weights_global_scaling_factor")] = weights.pop(name)
            elif name.endswith("activation_scaling_factor"):
                weights[name.replace("activation_scaling_factor", "activation_global_scaling_factor")] = weights.pop(
                    name
                )
        for name in list(weights):
            if name.endswith("weights_global_scaling_factor"):
                act = weights[name.replace("weights_global_scaling_factor", "activation_global_scaling_factor")]
                weights[name.replace("weights_global_scaling_factor", "alpha")] = act * weights[name]
    return weights


class DecoderModelForCausalLM(PretrainedModel):
    def __init__(self, config: PretrainedConfig, transformer: Module, lm_head: Linear):
        super().__init__(config)
        self.transformer = transformer
        self.lm_head = lm_head
        Attention.create_attention_const_params(self, config)


class GenerationMixin:
    """Build-time profile helpers `prepare_inputs` calls; the emulated runtime binds inputs itself."""

    @staticmethod
    def has_ctx_gen_opt_profiles(**kwargs: Any) -> bool:
        raise EmulationError("prepare_inputs is build-time only; the emulated runtime binds the inputs itself")

    @staticmethod
    def get_profiles_ranges(**kwargs: Any) -> Any:
        raise EmulationError("prepare_inputs is build-time only; the emulated runtime binds the inputs itself")

    @staticmethod
    def default_range(*args: Any, **kwargs: Any) -> Any:
        raise EmulationError("prepare_inputs is build-time only; the emulated runtime binds the inputs itself")
