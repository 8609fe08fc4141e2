"""The emulated engine: a converted checkpoint loaded into the unmodified network, and one network step.

It holds what a built engine fixes (the network, its draft length, its KV geometry and cache dtype, its batch and
token limits) and runs one forward over inputs the runtime prepared, returning the outputs the runtime binds.
Requests, scheduling and the KV pages belong to `executor.py`; this module knows nothing of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trt.checkpoint.trtllm_config import specs_from_config
from dflash_trt.emulation.aliasing import load_engine_module, stand_ins_installed
from dflash_trt.emulation.functional import EmulationError, Network, PluginConfig, net_guard
from dflash_trt.errors import DFlashTrtError
from dflash_trt.jsonfile import read_json_object
from dflash_trt.trtllm.build_plan import (
    chain_draft_paths,
    check_kv_geometry,
    check_moe_layers,
    check_quantization,
    check_rope,
    read_checkpoint_facts,
)

ACCEPT_OUTPUTS = (
    "accepted_tokens",
    "num_accepted_tokens",
    "accepted_paths",
    "next_draft_tokens",
    "next_draft_lens",
    "next_draft_paths",
    "logits",
)


@dataclass
class StepStats:
    """What the engine ran: steps, context chunks, the largest batch and the largest cumsum-by-square scan."""

    steps: int = 0
    context_chunks: int = 0
    max_batch: int = 0
    largest_cumsum_square: int = 0


class EmulatedEngine:
    """One engine (the network from `model.py`) over a converted checkpoint, with the limits a build would fix."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        max_batch_size: int = 8,
        max_num_tokens: int | None = None,
        tokens_per_block: int = 32,
    ):
        checkpoint_dir = Path(checkpoint_dir)
        raw = read_json_object(
            checkpoint_dir / "config.json", f"{checkpoint_dir} is not a converted checkpoint (no config.json)"
        )
        target, _ = specs_from_config(raw)
        # What `dflash-trt build` refuses, the emulated engine refuses too.
        self.facts = read_checkpoint_facts(checkpoint_dir)
        for check in (check_kv_geometry, check_rope, check_quantization, check_moe_layers):
            check(self.facts)
        if raw["mapping"].get("tp_size", 1) != 1 or raw["mapping"].get("pp_size", 1) != 1:
            raise DFlashTrtError("the emulation runs one rank: convert with --tp_size 1")
        if not (checkpoint_dir / "rank0.safetensors").is_file():
            raise DFlashTrtError(f"{checkpoint_dir} has no rank0.safetensors")
        self.vocab_size, self.eos_token_ids = target.vocab_size, target.eos_token_ids
        self.max_position_embeddings = target.max_position_embeddings
        engine = load_engine_module()
        self.model = engine.DFlashForCausalLM.from_checkpoint(checkpoint_dir)
        config = self.model.config
        self.k = self.model.max_draft_len
        self.block = self.k + 1
        if max_batch_size < 1:
            raise DFlashTrtError(f"--max_batch_size must be >= 1, got {max_batch_size}")
        if tokens_per_block <= 0 or tokens_per_block & (tokens_per_block - 1):
            raise DFlashTrtError(f"--tokens_per_block must be a power of two, got {tokens_per_block}")
        # builder.build() raises max_num_tokens to max_batch_size * (K + 1) for EAGLE engines.
        floor = max_batch_size * self.block
        self.max_num_tokens = max(max_num_tokens or 8192, floor)
        if max_num_tokens is not None and max_num_tokens < floor:
            raise DFlashTrtError(f"--max_num_tokens must be at least max_batch_size * block_size = {floor}")
        self.max_batch_size = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.num_target_layers = config.num_hidden_layers
        self.num_layers = config.num_hidden_layers + config.eagle_net_config["num_hidden_layers"]
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_size
        fp8_cache = config.quantization.kv_cache_quant_algo == "FP8"
        self.cache_dtype = torch.float8_e4m3fn if fp8_cache else torch.float32
        self.paths = torch.tensor(chain_draft_paths(self.k), dtype=torch.int32)
        self.stats = StepStats()

    def run(self, inputs: dict[str, Any], batch_size: int) -> dict[str, torch.Tensor]:
        """One network forward over `batch_size` requests: the outputs the runtime binds, checked as it binds them."""
        network = Network(PluginConfig(tokens_per_block=self.tokens_per_block))
        with stand_ins_installed(), net_guard(network), torch.no_grad():
            self.model.forward(**inputs)
        outputs = {}
        for name in ACCEPT_OUTPUTS:
            if name not in network.outputs:
                raise EmulationError(f"the network did not mark output '{name}'")
            outputs[name] = network.outputs[name].data
            if name != "logits" and outputs[name].dtype != torch.int32:
                raise EmulationError(f"output '{name}' is {outputs[name].dtype}, the runtime binds int32")
        self.stats.steps += 1
        self.stats.max_batch = max(self.stats.max_batch, batch_size)
        self.stats.largest_cumsum_square = max([self.stats.largest_cumsum_square, *network.cumsum_square_elements])
        return outputs
