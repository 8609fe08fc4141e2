"""Draft trees in build profiles: `engine.draft_tree` and `build --config P --draft_tree N` over it, checked by the
build's own rules (the node rule, the GPU's attention route, the schedule's node budgets) and built into the engine's
command, manifest and Triton repository. Oracles: the lengths and EAGLE choices worked out by hand from the tree's
nodes and draft positions; `AttentionRoute.check_tree` for which GPU verifies trees (never a list of GPUs here)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from _pairs import PairVariant, make_pair
from _profile_hub import profile_hub
from _profile_hub import tiny_profile as tiny_profile_file

from dflash_trt.cli import main as cli_main
from dflash_trt.errors import DFlashTrtError
from dflash_trt.gpu_targets import GPU_SMS
from dflash_trt.pipeline.profiles import load_profile
from dflash_trt.pipeline.resolve import PipelineRequest, resolve_inputs
from dflash_trt.pipeline.run import Outcome, run_pipeline
from dflash_trt.pipeline.stages import stages
from dflash_trt.trtllm.attention_route import AttentionRoute
from dflash_trt.trtllm.engine_manifest import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ROOT / "build_configs/h200-fp8/qwen3-8b.yaml"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    return profile_hub(tmp_path_factory.mktemp("hub"))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("pair"), PairVariant())


def tiny_profile(tmp_path: Path, pair: tuple[Path, Path], gpu: str = "h200", **engine) -> Path:
    """The tiny pair's profile with no draft-length schedule unless a test gives one."""
    return tiny_profile_file(tmp_path, pair, gpu, **{"draft_len_schedule": "none", **engine})


def engine_command(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[2/3] engine"))
    return shlex.split(lines[start + 1])


def dry_run(profile: Path, tmp_path: Path, *flags: str, capsys) -> tuple[int, str, str]:
    argv = ["build", "--config", str(profile), "--output_dir", str(tmp_path / "ws"), "--dry_run", *flags]
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_flag_builds_a_tree_from_a_shipped_profile(hub: Path, tmp_path: Path, capsys):
    """Qwen3-8B's block of 16 drafts 15 positions; a 32-node tree verifies 32 drafts, and the engine records
    8192 + 32 + 15 = 8239 (builder: max_seq_len + max_draft_len + num_eagle_layers). The profile's batch of 256
    would verify 256 x 33 = 8448 tokens a step, over its max_num_tokens of 8192: the build's rule refuses it."""
    flags = ["--hf_cache", str(hub), "--draft_tree", "32", "--draft_len_schedule", "none"]
    code, _, err = dry_run(QWEN3_8B, tmp_path, *flags, capsys=capsys)
    assert code == 2 and "256 x 33 = 8448" in err
    code, out, err = dry_run(QWEN3_8B, tmp_path, *flags, "--max_batch_size", "64", capsys=capsys)
    assert code == 0, err
    command = engine_command(out)
    assert "DFLASH_TRT_DRAFT_TREE=32" in command
    assert command[command.index("--max_draft_len") + 1] == "32"
    assert "records max_seq_len 8239 = 8192 + 32 + 15" in out
    assert not (tmp_path / "ws").exists()


def test_the_chains_node_count_is_the_chain(hub: Path, tmp_path: Path, capsys):
    code, out, err = dry_run(
        QWEN3_8B, tmp_path, "--hf_cache", str(hub), "--draft_tree", "15", "--draft_len_schedule", "none", capsys=capsys
    )
    assert code == 0, err
    command = engine_command(out)
    assert not any(arg.startswith("DFLASH_TRT_DRAFT_TREE=") for arg in command)
    assert command[command.index("--max_draft_len") + 1] == "15"


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ("10", "--draft_tree 10: a tree holds at least the chain's 15 drafts"),
        ("257", "--draft_tree 257: an EAGLE engine verifies at most 256 drafts"),
    ],
)
def test_the_flag_takes_the_node_rule(hub: Path, tmp_path: Path, capsys, nodes: str, message: str):
    code, _, err = dry_run(
        QWEN3_8B, tmp_path, "--hf_cache", str(hub), "--draft_tree", nodes, "--draft_len_schedule", "none", capsys=capsys
    )
    assert code == 2 and message in err


def schedule_env(out: str) -> list[tuple[int, int]]:
    """The engine command's draft-length schedule, ((min_requests, drafts verified per request), ...)."""
    (text,) = [a.split("=", 1)[1] for a in engine_command(out) if a.startswith("DFLASH_TRT_DRAFT_LEN_SCHEDULE=")]
    return [tuple(map(int, step.split(":"))) for step in text.split(",")]  # type: ignore[misc]


def test_a_tree_profiles_auto_derives_node_budgets(hub: Path, tmp_path: Path, capsys):
    """The shipped profile's `auto` over a 32-node tree derives node budgets (at most 32, wider than the chain's 15
    drafts at a light load, falling with it), not the chain's draft lengths."""
    flags = ["--hf_cache", str(hub), "--max_batch_size", "64"]
    code, out, err = dry_run(QWEN3_8B, tmp_path, *flags, "--draft_tree", "32", capsys=capsys)
    assert code == 0, err
    tree = schedule_env(out)
    code, out, err = dry_run(QWEN3_8B, tmp_path, *flags, capsys=capsys)
    assert code == 0, err
    chain = schedule_env(out)
    budgets = [b for _, b in tree]
    assert max(budgets) <= 32 and budgets[0] > 15 and budgets == sorted(budgets, reverse=True)
    assert max(b for _, b in chain) <= 15 and tree != chain


def test_the_profile_key_sizes_the_steps_tokens_by_the_nodes(tiny_pair, tmp_path: Path):
    """4 requests x (24 + 1) verified tokens + one 64-token prompt = 164 tokens a step; the chain needs 4 x 8 + 64."""
    assert load_profile(tiny_profile(tmp_path, tiny_pair, draft_tree=24, max_num_tokens=164)).engine.draft_tree == 24
    with pytest.raises(DFlashTrtError, match=r"below max_batch_size x \(draft_tree \+ 1\) \+ .* = 164"):
        load_profile(tiny_profile(tmp_path, tiny_pair, draft_tree=24, max_num_tokens=163))
    assert load_profile(tiny_profile(tmp_path, tiny_pair, max_num_tokens=96)).engine.draft_tree is None


@pytest.mark.parametrize("gpu", sorted(GPU_SMS))
def test_a_profile_tree_is_built_on_every_gpu(tiny_pair, tmp_path: Path, gpu: str):
    """Every GPU verifies trees (stock XQA on Hopper, DFlashAttention's packed tree mask on Blackwell): the profile
    key and the flag over a chain profile both build the tree."""
    AttentionRoute(GPU_SMS[gpu]).check_tree(gpu, 24)
    assert load_profile(tiny_profile(tmp_path, tiny_pair, gpu, draft_tree=24)).engine.draft_tree == 24
    chain = tiny_profile(tmp_path, tiny_pair, gpu)
    override = lambda settings: settings.__class__(**{**settings.__dict__, "draft_tree": 24})  # noqa: E731
    request = PipelineRequest(str(chain), str(tmp_path / "ws"), dry_run=True)
    assert resolve_inputs(request, override).settings.draft_tree == 24


def test_the_profile_key_takes_the_node_rule(tiny_pair, tmp_path: Path):
    with pytest.raises(DFlashTrtError, match="engine.draft_tree 5: a tree holds at least the chain's 7"):
        load_profile(tiny_profile(tmp_path, tiny_pair, draft_tree=5))


def test_a_tree_profile_builds_the_tree_engine_and_its_repository(tiny_pair, tmp_path: Path, monkeypatch):
    """The engine stage's trtllm-build is replaced by a writer of what it leaves (config.json + manifest); the
    manifest and the Triton repository are the pipeline's own. 24 nodes over 7 positions: max_draft_len 24, the
    EAGLE choices the chain of depth 7, the engine's max_seq_len 128 + 24 + 7 = 159."""

    def fake_engine_build(plan, overwrite=False):
        out = Path(plan.output_dir)
        out.mkdir(parents=True, exist_ok=overwrite)
        (out / "config.json").write_text(json.dumps({"build_config": plan.build_config}))
        (out / MANIFEST_NAME).write_text(json.dumps(plan.dflash_manifest))
        return out

    monkeypatch.setattr("dflash_trt.trtllm.build.run_engine_build", fake_engine_build)
    ws = tmp_path / "ws"
    request = PipelineRequest(str(tiny_profile(tmp_path, tiny_pair, draft_tree=24)), str(ws), plugin_library="/x.so")
    results = run_pipeline(stages(resolve_inputs(request)), gpu=True)
    assert [r.outcome for r in results] == [Outcome.BUILT] * 3
    manifest = json.loads((ws / "engine" / MANIFEST_NAME).read_text())
    assert (manifest["max_draft_len"], manifest["draft_tree"], manifest["max_seq_len"]) == (24, 24, 159)
    assert manifest["eagle_choices"] == [[0] * depth for depth in range(1, 8)]
    repository = json.loads((ws / "triton/dflash_triton.json").read_text())
    assert (repository["max_draft_len"], repository["eagle_depth"]) == (24, 7)
    params = (ws / "triton/tensorrt_llm/config.pbtxt").read_text()
    assert '"eagle_choices" value { string_value: "{0}, {0, 0}, {0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0, 0}, ' in params
    assert '{0, 0, 0, 0, 0, 0, 0}" }' in params and "{0, 0, 0, 0, 0, 0, 0, 0}" not in params


def test_a_tree_profiles_table_holds_node_budgets(tiny_pair, tmp_path: Path):
    """On a 24-node tree a table's values are node budgets: 20 (past the chain's 7 drafts) is a tree, 30 is refused."""
    table = load_profile(tiny_profile(tmp_path, tiny_pair, draft_tree=24, draft_len_schedule="2:20,4:5"))
    assert table.engine.draft_tree == 24
    with pytest.raises(DFlashTrtError, match="2:30 verifies 30 drafts per request but the engine verifies at most 24"):
        load_profile(tiny_profile(tmp_path, tiny_pair, draft_tree=24, draft_len_schedule="2:30"))
    with pytest.raises(DFlashTrtError, match="2:20 verifies 20 drafts per request but the engine verifies at most 7"):
        load_profile(tiny_profile(tmp_path, tiny_pair, draft_len_schedule="2:20"))
