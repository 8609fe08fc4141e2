"""An HF hub cache holding the config.json of every shipped profile's models (recorded ones, and stand-ins for the
two drafters nobody recorded), so profile dry runs plan the whole engine without downloading anything."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECORDED_PATH = ROOT / "dflash_trt/assets/recorded_configs.yaml"
RECORDED = yaml.safe_load(RECORDED_PATH.read_text())
# Stand-ins for the two drafters whose config.json is recorded as unknown (plausible z-lab-format shapes), so the
# full plan path also runs for their profiles when a config.json is on disk.
STAND_IN_DRAFTS = {
    "AICP-Labs/qwen3-32b-dflash-en-zh": {
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_target_layers": 64,
        "block_size": 16,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 16, 31, 46, 61]},
    },
    "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat": {
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_target_layers": 32,
        "block_size": 10,
        "rms_norm_eps": 1e-5,
        **{k: RECORDED["meta-llama/Llama-3.1-8B-Instruct"][k] for k in ("rope_theta", "rope_scaling")},
        "dflash_config": {"mask_token_id": 128002, "target_layer_ids": [1, 8, 15, 22, 29]},
    },
}
HUB_CONFIGS = {**{ref: cfg for ref, cfg in RECORDED.items() if "unknown" not in cfg}, **STAND_IN_DRAFTS}


def profile_hub(cache: Path) -> Path:
    """`cache` laid out as an HF hub cache (models--org--name/snapshots/<rev>, refs/main) of the profiles' configs."""
    for repo, cfg in HUB_CONFIGS.items():
        repo_dir = cache / ("models--" + repo.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(cfg))
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / "main").write_text("0123abcd")
    return cache


def tiny_profile(tmp_path: Path, pair: tuple[Path, Path], gpu: str = "h200", **engine) -> Path:
    """The fixture pair (block 8: 7 draft positions) as a build profile for `gpu`, `engine` over its engine keys.
    Its head dim (16) builds only where the stock plugin attends (h100 / h200) unless the test expects a refusal."""
    target, draft = pair
    data = {
        "name": "tiny",
        "gpu": gpu,
        "model": {"target": str(target), "draft": str(draft), "block_size": 8},
        "quantization": {"qformat": "none", "dflash_qformat": "none", "kv_cache_dtype": "none"},
        "engine": {
            "max_batch_size": 4,
            "max_input_len": 64,
            "max_seq_len": 128,
            "max_num_tokens": 256,
            "max_draft_len": 7,
            "gemm_plugin": "auto",
            **engine,
        },
        "serving": {"instance_count": 1},
        "sweep": {"concurrency": [1, 4], "interactivity_band": [100, 200]},
    }
    path = tmp_path / f"tiny-{gpu}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
