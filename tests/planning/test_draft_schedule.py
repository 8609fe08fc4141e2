"""The draft-length schedule: its one parsing rule, its meaning, and `auto` as the planner derives it (the golden
loop under a schedule: tests/golden/test_golden_draft_schedule.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dflash_trt.analysis.draft_schedule import (
    LOWEST_PUBLISHED,
    default_acceptance,
    derive_schedule,
    non_increasing_choice,
)
from dflash_trt.analysis.gpus import get_gpu
from dflash_trt.analysis.harness_fits import calibration
from dflash_trt.analysis.model import Acceptance, Deployment, Method, dflash_step, mean_context
from dflash_trt.analysis.published import PAIRS
from dflash_trt.cli import main
from dflash_trt.draft_schedule import AUTO, FIXED, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.inputs import DRAFT_LEN_SCHEDULE

RULE = DRAFT_LEN_SCHEDULE.describe()


@pytest.mark.parametrize(
    "text, steps",
    [
        ("none", ()),
        (" 1:15,16:7,64:3 ", ((1, 15), (16, 7), (64, 3))),
        ("8:3", ((8, 3),)),
        ("2:5, 4:5", ((2, 5), (4, 5))),  # equal draft lengths are allowed, rising ones are not
    ],
)
def test_tables_and_none_parse_to_their_steps(text: str, steps: tuple):
    assert DRAFT_LEN_SCHEDULE(text) == DraftLenSchedule(steps)
    assert DRAFT_LEN_SCHEDULE("auto") == AUTO


@pytest.mark.parametrize(
    "text",
    ["", "1", "1:", ":3", "1:3,", "16:7,1:15", "1:3,1:2", "1:3,8:4", "0:3", "1:0", "-1:3", "1:3:4", "a:b", "1:²",
     "AUTO", "1:2147483648", ",".join(f"{n}:1" for n in range(1, 66))],
)  # fmt: skip
def test_bad_tables_are_refused_in_one_message_style(text: str):
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be auto, none or N1:K1,N2:K2"):
        DRAFT_LEN_SCHEDULE(text)
    with pytest.raises(DFlashTrtError) as refused:
        DRAFT_LEN_SCHEDULE.check(text, "engine.draft_len_schedule")
    assert str(refused.value).startswith(f"engine.draft_len_schedule must be {RULE}, got ")
    with pytest.raises(DFlashTrtError):
        DRAFT_LEN_SCHEDULE.check(3, "engine.draft_len_schedule")  # a YAML number is not a table


def test_a_schedule_names_the_draft_length_of_each_load():
    schedule = DraftLenSchedule(((2, 9), (5, 4), (9, 1)))
    got = [schedule.draft_len(load, 15) for load in range(1, 12)]
    assert got == [15, 9, 9, 9, 4, 4, 4, 4, 1, 1, 1]  # below the first threshold: the full draft
    assert [FIXED.draft_len(load, 7) for load in (1, 100)] == [7, 7]
    assert schedule.text() == "2:9,5:4,9:1" and FIXED.text() == "none"
    assert schedule.fitted_to(9) is schedule
    with pytest.raises(DFlashTrtError, match=r"verifies 9 drafts per request but the engine verifies at most 7 "):
        schedule.fitted_to(7)


def _best_by_enumeration(scores: list[list[float]]) -> float:
    """The best total over every index sequence that never rises, by enumeration."""
    best = float("-inf")

    def walk(row: int, ceiling: int, total: float) -> None:
        nonlocal best
        if row == len(scores):
            best = max(best, total)
            return
        for j in range(ceiling + 1):
            walk(row + 1, j, total + scores[row][j])

    walk(0, len(scores[0]) - 1, 0.0)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_non_increasing_choice_is_the_best_of_all(seed: int):
    import random

    rng = random.Random(seed)
    scores = [[rng.uniform(-1, 1) for _ in range(4)] for _ in range(5)]
    path = non_increasing_choice(scores)
    assert all(b <= a for a, b in zip(path, path[1:], strict=False))
    assert sum(row[j] for row, j in zip(scores, path, strict=True)) == pytest.approx(_best_by_enumeration(scores))


def test_auto_takes_each_batchs_best_draft_length_for_a_dense_target():
    """Qwen3-8B on one H100: the best draft length falls with the batch, so auto is the per-batch optimum; the
    step it prices verifies K + 1 tokens and drafts the whole block (our engine), checked against the model's own
    per-step cost at every batch."""
    target, drafter = PAIRS["qwen3-8b"].load()
    acc = Acceptance.from_mean(3.16, 16)
    dep = Deployment(get_gpu("h100"), "fp8", "fp8", 1, calibration("trtllm"))
    ctx = mean_context(1024, 1024)
    derived = derive_schedule(target, drafter, acc, dep, ctx, 128)
    assert [r.batch for r in derived.rows] == list(range(1, 129))
    assert all(r.draft_len == r.best_draft_len for r in derived.rows)
    assert derived.rows[0].draft_len == 15 and derived.rows[-1].draft_len < 8  # long drafts alone, short ones at load
    for r in derived.rows[::17]:
        tps = []
        for k in range(1, 16):
            cut = acc.resized(k + 1)
            cost = dflash_step(target, drafter, r.batch, k + 1, cut.mean(), ctx, dep, drafter.block_size)
            tps.append(r.batch * cut.mean() / dep.calibration.seconds(cost))
        assert r.best_draft_len == tps.index(max(tps)) + 1
        assert r.scheduled_tok_s == pytest.approx(max(tps)) and r.fixed_tok_s == pytest.approx(tps[-1])
        assert r.ar_tok_s == pytest.approx(r.batch / Method("ar").iteration(target, r.batch, ctx, dep).seconds)
    for r in derived.rows:  # the table reproduces the per-batch choices
        assert derived.schedule.draft_len(r.batch, 15) == r.draft_len


def test_without_published_acceptance_auto_states_its_assumption():
    acc, note = default_acceptance(None, 10)
    assert acc.max_length == 10 and "assumed" in note and str(LOWEST_PUBLISHED[0]) in note
    acc, note = default_acceptance("qwen3-4b", 16)
    assert "lowest qwen3-4b publishes" in note and acc.mean() == pytest.approx(2.99, abs=1e-6)


@pytest.fixture(scope="module")
def qwen3_8b_checkpoint(tmp_path_factory) -> Path:
    """A converted Qwen3-8B + z-lab drafter checkpoint as planning sees it (config.json, empty rank files)."""
    from _engine_checkpoints import write_checkpoint

    from dflash_trt.analysis.published import QWEN3_8B, QWEN3_8B_DFLASH_B16

    return write_checkpoint(tmp_path_factory.mktemp("q8") / "ckpt", QWEN3_8B, QWEN3_8B_DFLASH_B16)


def _build(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["build", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_build_auto_derives_the_table_it_hands_to_the_network(qwen3_8b_checkpoint: Path, tmp_path: Path, capsys):
    base = ["--checkpoint_dir", str(qwen3_8b_checkpoint), "--output_dir", str(tmp_path / "e"), "--dry_run"]
    code, out, err = _build([*base, "--json", "--draft_len_schedule", "auto", "--gpu", "h100"], capsys)
    assert code == 0
    plan = json.loads(out)
    table = plan["dflash_manifest"]["draft_len_schedule"]
    # The same derivation from the published shapes (not the checkpoint's config.json), bf16 on one H100.
    target, drafter = PAIRS["qwen3-8b"].load()
    acc, _ = default_acceptance(None, 16)
    dep = Deployment(get_gpu("h100"), "bf16", "bf16", 1, calibration("trtllm"))
    want = derive_schedule(target, drafter, acc, dep, mean_context(1024, 1024), 64).schedule
    assert table == want.text() and want.steps
    assert f"draft-length schedule {table} (auto: trtllm calibration, h100 x1" in err
    code, out, err = _build([*base, "--draft_len_schedule", "2:9,8:3"], capsys)
    assert code == 0 and "DFLASH_TRT_DRAFT_LEN_SCHEDULE=2:9,8:3 trtllm-build" in out
    assert '"draft_len_schedule": "2:9,8:3"' in out


def test_build_auto_derives_a_draft_trees_node_budgets(qwen3_8b_checkpoint: Path, tmp_path: Path, capsys):
    """`--draft_tree 40 --draft_len_schedule auto`: the manifest and the model class's environment get the node
    budgets the one derivation gives over 1..40 (trees at small loads, the chain or less under load); a table is
    bounded by the tree's nodes, not by the block."""
    base = ["--checkpoint_dir", str(qwen3_8b_checkpoint), "--output_dir", str(tmp_path / "e"), "--dry_run"]
    base += ["--gpu", "h200", "--draft_tree", "40"]
    code, out, err = _build([*base, "--json", "--draft_len_schedule", "auto"], capsys)
    assert code == 0
    manifest = json.loads(out)["dflash_manifest"]
    target, drafter = PAIRS["qwen3-8b"].load()
    acc, _ = default_acceptance(None, 16)
    dep = Deployment(get_gpu("h200"), "bf16", "bf16", 1, calibration("trtllm"))
    want = derive_schedule(target, drafter, acc, dep, mean_context(1024, 1024), 64, nodes=40).schedule
    assert (manifest["draft_len_schedule"], manifest["draft_tree"]) == (want.text(), 40)
    assert want.draft_len(1, 40) > 15 >= want.draft_len(64, 40)
    assert "node budgets of a draft tree of at most 40 nodes" in err
    code, out, err = _build([*base, "--draft_len_schedule", "1:40,8:15,32:4"], capsys)
    assert code == 0 and "DFLASH_TRT_DRAFT_LEN_SCHEDULE=1:40,8:15,32:4" in out and "DFLASH_TRT_DRAFT_TREE=40" in out
    assert '"draft_len_schedule": "1:40,8:15,32:4"' in out
    code, out, err = _build([*base, "--draft_len_schedule", "2:41"], capsys)
    assert code == 2 and "verifies 41 drafts per request but the engine verifies at most 40" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--draft_len_schedule", "auto"], "--draft_len_schedule auto prices each step on a GPU: give --gpu"),
        (["--draft_len_schedule", "1:16"], "verifies 16 drafts per request but the engine verifies at most 15 "),
        (["--acceptance_json", "a.json"], "--acceptance_json only serves --draft_len_schedule auto"),
    ],
)
def test_build_refuses_a_schedule_it_cannot_build(qwen3_8b_checkpoint, tmp_path, capsys, flags, message):
    argv = ["--checkpoint_dir", str(qwen3_8b_checkpoint), "--output_dir", str(tmp_path / "e"), "--dry_run", *flags]
    code, out, err = _build(argv, capsys)
    assert code == 2 and out == "" and err.startswith("dflash-trt build: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_malformed_table_is_refused_by_the_parser(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["build", "--checkpoint_dir", str(tmp_path), "--output_dir", str(tmp_path / "e"), "--draft_len_schedule",
              "4:2,2:4"])  # fmt: skip
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument --draft_len_schedule: must be {RULE}, got '4:2,2:4'" in err


SHIPPED = sorted((Path(__file__).resolve().parents[2] / "build_configs").glob("*/*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_profiles_auto_schedule_leaves_no_avoidable_loss(path: Path):
    """Every shipped profile's `auto` table, at every batch up to its engine's max_batch_size: never below the full
    draft at one user, within the non-increasing table's price of each batch's best draft length, and below AR only
    where no draft length of one or more beats AR by 2 % (the drafter's full-block pass or a MoE target's expert
    reads cost more than any verified draft returns there; docs/performance.md lists those rows; at the MoE target's
    edge the best draft length beats AR by 0.2 % and the non-increasing table falls 0.4 % short of it)."""
    from dflash_trt.analysis.published import pair_for_models
    from dflash_trt.pipeline.profiles import load_profile
    from dflash_trt.pipeline.schedule import profile_schedule

    profile = load_profile(path)
    target, drafter = PAIRS[pair_for_models(profile.model.target, profile.model.draft)].load()
    resolved = profile_schedule(profile, target, drafter)
    rows = resolved.derived.rows
    assert [r.batch for r in rows] == list(range(1, profile.engine.max_batch_size + 1))
    assert rows[0].scheduled_tok_s >= rows[0].fixed_tok_s * (1 - 1e-12)
    for r in rows:
        assert resolved.schedule.draft_len(r.batch, drafter.block_size - 1) == r.draft_len
        assert r.scheduled_tok_s >= 0.94 * r.best_tok_s
        assert r.scheduled_tok_s >= r.ar_tok_s or r.best_tok_s < 1.02 * r.ar_tok_s, r


def _plan_json(argv: list[str], capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_prints_the_schedule_with_and_without_it(capsys):
    base = ["--preset", "qwen3-8b", "--gpu", "h200", "--qformat", "fp8", "--workload", "alpaca"]
    out = _plan_json([*base, "--concurrency", "1,16,64,256", "--draft_len_schedule", "auto"], capsys)
    section = out["draft_len_schedule"]
    schedule = DRAFT_LEN_SCHEDULE(section["schedule"])
    assert section["steps"] == [list(s) for s in schedule.steps] and schedule.steps
    assert any(note.startswith(f"draft-length schedule auto = {section['schedule']} ") for note in out["notes"])
    (rows,) = section["rows"].values()
    assert [r["batch"] for r in rows] == [1, 16, 64, 256]
    # The dflash curve is the scheduled engine; the fixed draft is beaten under load and matched at one user.
    curve = {p["concurrency"]: p["tok_s_gpu"][0] for p in out["curves"]["dflash"]}
    for r in rows:
        assert curve[r["batch"]] == pytest.approx(r["scheduled_tok_s"])
        assert r["draft_len"] == schedule.draft_len(r["batch"], 15)
    assert rows[0]["scheduled_tok_s"] == pytest.approx(rows[0]["fixed_tok_s"])
    assert rows[-1]["scheduled_tok_s"] > 1.2 * rows[-1]["fixed_tok_s"] and rows[-1]["draft_len"] < 15
    given = _plan_json([*base, "--concurrency", "8", "--draft_len_schedule", "4:2"], capsys)
    assert given["draft_len_schedule"]["schedule"] == "4:2"
    assert main(["plan", *base, "--draft_len_schedule", "auto", "--max_draft_len", "7"]) == 2
    assert "give one" in capsys.readouterr().err


def test_plan_config_shows_the_profiles_table(capsys):
    path = SHIPPED[0]
    out = _plan_json(["--config", str(path)], capsys)
    section = out["draft_len_schedule"]
    assert section["source"].startswith("auto: trtllm calibration")
    assert DRAFT_LEN_SCHEDULE(section["schedule"]) is not None and section["rows"]


def _batches(rows: list) -> str:
    """`a-b` spans of the batches listed (or `-`)."""
    spans: list[list[int]] = []
    for r in rows:
        if spans and spans[-1][1] == r.batch - 1:
            spans[-1][1] = r.batch
        else:
            spans.append([r.batch, r.batch])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) or "-"


def schedule_table() -> str:
    """docs/performance.md §3.7: every shipped profile's `auto` table and what it changes, batch 1..max."""
    from dflash_trt.analysis.published import pair_for_models
    from dflash_trt.pipeline.profiles import load_profile
    from dflash_trt.pipeline.schedule import profile_schedule

    lines = [
        "| profile | acceptance | `auto` (N:K) | full K below AR at | `auto` below AR at | worst `auto` / AR | "
        "`auto` / full K at 1 and at max |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in SHIPPED:
        profile = load_profile(path)
        target, drafter = PAIRS[pair_for_models(profile.model.target, profile.model.draft)].load()
        resolved = profile_schedule(profile, target, drafter)
        rows = resolved.derived.rows
        worst = min(rows, key=lambda r: r.scheduled_tok_s / r.ar_tok_s)
        tau = default_acceptance(pair_for_models(profile.model.target, profile.model.draft), drafter.block_size)
        lines.append(
            f"| {profile.name} | {tau[0].mean():.2f}{'' if 'publishes:' in tau[1] else ' (assumed)'} | "
            f"{resolved.schedule.text()} | {_batches([r for r in rows if r.fixed_tok_s < r.ar_tok_s])} | "
            f"{_batches([r for r in rows if r.scheduled_tok_s < r.ar_tok_s])} | "
            f"{worst.scheduled_tok_s / worst.ar_tok_s:.2f} (batch {worst.batch}) | "
            f"{rows[0].scheduled_tok_s / rows[0].fixed_tok_s:.2f} / "
            f"{rows[-1].scheduled_tok_s / rows[-1].fixed_tok_s:.2f} |"
        )
    return "\n".join(lines)


def test_docs_carry_the_current_schedule_table():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "performance.md").read_text()
    assert schedule_table() in docs
