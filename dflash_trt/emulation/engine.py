"""The emulated engine: a converted checkpoint loaded into the unmodified network, and one network step.

It holds what a built engine fixes (the network, its draft length, its KV geometry and cache dtype, its batch and
token limits) and runs one forward over inputs the runtime prepared, returning the outputs the runtime binds.
Requests, scheduling and the KV pages belong to the emulated executor (`dflash_trt/executors/emulated.py`); this
module knows nothing of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dflash_trt.checkpoint.trtllm_config import specs_from_config
from dflash_trt.draft_schedule import FIXED, DraftLenSchedule
from dflash_trt.emulation.functional import EmulationError, Network, PluginConfig, Tensor, net_guard
from dflash_trt.emulation.kv_pool import KVPool, pool_at
from dflash_trt.emulation.models import set_fp8_context_fhma
from dflash_trt.emulation.ranks import RankGroup
from dflash_trt.emulation.stand_ins import load_engine_module, stand_ins_installed
from dflash_trt.errors import DFlashTrtError
from dflash_trt.formats import NVFP4, fp8_context_fmha
from dflash_trt.gpu_targets import ASSUMED_GPU, check_nvfp4_gpu, gpu_sm
from dflash_trt.jsonfile import read_json_object
from dflash_trt.trtllm.attention_route import AttentionRoute
from dflash_trt.trtllm.build_limits import TOKENS_PER_BLOCK
from dflash_trt.trtllm.build_settings import EngineBuildSettings
from dflash_trt.trtllm.checkpoint_facts import kv_cache_format, read_checkpoint_facts, weights_qformat
from dflash_trt.trtllm.eagle_layout import chain_draft_paths
from dflash_trt.trtllm.network_checks import check_network

DEFAULT_MAX_BATCH_SIZE = 8  # requests the emulated engine batches when no --max_batch_size is given
CONTEXT_REQUEST, GENERATION_REQUEST = 0, 1  # host_request_types values (RequestType in the C++ runtime)
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
    """What the engine ran, counted by the engine from the inputs it ran: steps, context chunks (rows of context
    requests), the largest batch, the largest cumsum-by-square scan, the largest position any attention layer
    rotated a token to, and the steps whose verification took the sampling branch (the others took the greedy one:
    `verify.pick_tokens`)."""

    steps: int = 0
    context_chunks: int = 0
    max_batch: int = 0
    largest_cumsum_square: int = 0
    largest_position: int = -1
    sampling_steps: int = 0


class EmulatedEngine:
    """One engine (the network from `model.py`) over a converted checkpoint, with the limits a build would fix, as
    built for and run on `gpu` (which decides the attention kernels, trtllm/attention_route.py)."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_num_tokens: int | None = None,
        tokens_per_block: int = TOKENS_PER_BLOCK,
        gpu: str = ASSUMED_GPU,
        draft_len_schedule: DraftLenSchedule = FIXED,
        draft_tree: int | None = None,
    ):
        checkpoint_dir = Path(checkpoint_dir)
        raw = read_json_object(
            checkpoint_dir / "config.json", f"{checkpoint_dir} is not a converted checkpoint (no config.json)"
        )
        target, _ = specs_from_config(raw)
        # What `dflash-trt build` refuses, the emulated engine refuses too.
        self.facts = read_checkpoint_facts(checkpoint_dir)
        check_network(self.facts)
        if weights_qformat(self.facts) == NVFP4:
            check_nvfp4_gpu(gpu, "the checkpoint's quantization")
        self.tp_size = self.facts.tp_size
        for rank in range(self.tp_size):
            if not (checkpoint_dir / f"rank{rank}.safetensors").is_file():
                raise DFlashTrtError(
                    f"{checkpoint_dir} has no rank{rank}.safetensors (its config says tp_size {self.tp_size})"
                )
        self.vocab_size, self.eos_token_ids = target.vocab_size, target.eos_token_ids
        self.max_position_embeddings = target.max_position_embeddings
        self.gpu = gpu
        self.route = AttentionRoute(gpu_sm(gpu))
        engine = load_engine_module()
        # One network per tensor-parallel rank, each from its own rank file, run in lockstep (ranks.py); the config
        # carries the schedule and a draft tree's node count as an engine's config.json does (trtllm-build takes them
        # from SCHEDULE_ENV and TREE_ENV).
        config_dict = {**raw, "draft_len_schedule": draft_len_schedule.text(), "draft_tree": draft_tree}
        self.rank_models = [
            engine.DFlashForCausalLM.from_checkpoint(
                checkpoint_dir, rank=rank, config=engine.DFlashConfig.from_dict(config_dict)
            )
            for rank in range(self.tp_size)
        ]
        for model in self.rank_models:
            model.attention_route = self.route
        self.model = self.rank_models[0]
        self.ranks = RankGroup(self.tp_size)
        config = self.model.config
        self.k = self.model.max_draft_len  # drafts verified per request: the chain's length or the tree's nodes
        self.block = self.k + 1
        self.depth = self.model.num_drafts  # draft positions: the chain's length, a tree's deepest node
        self.tree = self.model.tree is not None
        if self.tree:
            self.route.check_tree(gpu, self.k)
        self.schedule = config.schedule
        self.max_num_tokens = step_tokens(max_batch_size, max_num_tokens, tokens_per_block, self.block)
        self.max_batch_size = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.num_target_layers = config.num_hidden_layers
        self.num_layers = config.num_hidden_layers + config.eagle_net_config["num_hidden_layers"]
        # Per rank: the pool of each rank holds its own (possibly replicated) KV heads.
        self.kv_heads, self.head_dim = (
            self.model.transformer.layers[0].attention.num_attention_kv_heads,
            config.head_size,
        )
        fp8_cache = config.quantization.kv_cache_quant_algo == "FP8"
        # The cache holds the activations' dtype (the checkpoint's), or FP8.
        self.cache_dtype = torch.float8_e4m3fn if fp8_cache else getattr(torch, config.dtype)
        # The paths a request starts from (the chain's EAGLE choices); after its first step, the ones the engine emits.
        self.paths = [row[: self.depth + 1] for row in chain_draft_paths(self.k)]
        self.plugin_config = PluginConfig(
            tokens_per_block=tokens_per_block,
            use_fp8_context_fmha=fp8_context_fmha(weights_qformat(self.facts), kv_cache_format(self.facts)),
        )
        if self.plugin_config.use_fp8_context_fmha:
            for model in self.rank_models:
                set_fp8_context_fhma(model)
        self.stats = StepStats()

    def run(self, inputs: dict[str, Any], batch_size: int) -> dict[str, torch.Tensor]:
        """One network forward over `batch_size` requests: the outputs the runtime binds, checked as it binds them.
        With tensor parallelism every rank runs its network on its own pool, in lockstep; the ranks must agree on
        every output (all of them follow the all-gathered logits), and the runtime reads rank 0's."""
        pool = pool_at(int(inputs["kv_cache_params"].host_kv_cache_pool_pointers.data[0, 0]))
        if pool is None:
            raise EmulationError("no KV pool at the runtime's pool pointer")
        work = [
            partial(self._forward, model, _on_pool(inputs, pool.pool_of_rank(rank, self.tp_size)))
            for rank, model in enumerate(self.rank_models)
        ]
        with stand_ins_installed():
            results = [work[0]()] if self.tp_size == 1 else self.ranks.run(work)
        outputs, network = results[0]
        for rank, (other, _) in enumerate(results[1:], start=1):
            differing = [name for name in ACCEPT_OUTPUTS if not torch.equal(other[name], outputs[name])]
            if differing:
                raise EmulationError(f"tp rank {rank} disagrees with rank 0 on {differing}")
        self.stats.steps += 1
        types = inputs["attention_params"].host_request_types.data
        self.stats.context_chunks += int((types == CONTEXT_REQUEST).sum())
        self.stats.max_batch = max(self.stats.max_batch, batch_size)
        self.stats.largest_cumsum_square = max([self.stats.largest_cumsum_square, *network.cumsum_square_elements])
        self.stats.largest_position = max(self.stats.largest_position, network.largest_position)
        self.stats.sampling_steps += any(network.branches_taken)
        return outputs

    def _forward(self, model: Any, inputs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Network]:
        """One rank's network forward and the outputs it marked."""
        network = Network(dataclasses.replace(self.plugin_config), device_sm=self.route.sm)
        with net_guard(network), torch.no_grad():
            model.forward(**inputs)
        outputs = {}
        for name in ACCEPT_OUTPUTS:
            if name not in network.outputs:
                raise EmulationError(f"the network did not mark output '{name}'")
            outputs[name] = network.outputs[name].data
            if name != "logits" and outputs[name].dtype != torch.int32:
                raise EmulationError(f"output '{name}' is {outputs[name].dtype}, the runtime binds int32")
        return outputs, network


def _on_pool(inputs: dict[str, Any], pool: KVPool) -> dict[str, Any]:
    """The runtime's inputs for one rank: the same, with that rank's pool behind the pool pointer."""
    kv = inputs["kv_cache_params"]
    pointers = Tensor(data=torch.tensor([[pool.address, 0]], dtype=torch.int64), host=True)
    return {**inputs, "kv_cache_params": dataclasses.replace(kv, host_kv_cache_pool_pointers=pointers)}


def step_tokens(max_batch_size: int, max_num_tokens: int | None, tokens_per_block: int, block: int) -> int:
    """The tokens one step takes, as the engine's build settles them; what no engine could run is refused."""
    if max_batch_size < 1:
        raise DFlashTrtError(f"--max_batch_size must be >= 1, got {max_batch_size}")
    if tokens_per_block <= 0 or tokens_per_block & (tokens_per_block - 1):
        raise DFlashTrtError(f"--tokens_per_block must be a power of two, got {tokens_per_block}")
    # builder.build() raises max_num_tokens to max_batch_size * (K + 1) for EAGLE engines.
    floor = max_batch_size * block
    if max_num_tokens is not None and max_num_tokens < floor:
        raise DFlashTrtError(f"--max_num_tokens must be at least max_batch_size * block_size = {floor}")
    tokens = max(max_num_tokens or EngineBuildSettings.max_num_tokens, floor)
    if tokens < tokens_per_block:
        # Prompt chunks are whole KV pages: a step smaller than a page could never take a long prompt's chunk.
        raise DFlashTrtError(
            f"--max_num_tokens {tokens} is below --tokens_per_block {tokens_per_block}: a prompt "
            "longer than one step is cut into chunks of whole KV pages, so no chunk would fit in a step"
        )
    return tokens
