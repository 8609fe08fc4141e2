"""Hostile values: every value a user can type is refused with exit 2 and one stderr line naming the
flag or field and its allowed range, before anything runs or is written; sizes are checked against the model and
the machine before any allocation; `--overwrite` replaces only what the same command wrote.

Calls run in-process through `dflash_trt.cli.main` on real inputs (the embedded tiny pair, whose target has 256
positions and 128 tokens, converted; a build profile; a sweep config).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from _hostile_cli import World, assert_refused, make_world, run_cli, snapshot

from dflash_trt.checkpoint.atomic import OUTPUT_MARKER
from dflash_trt.prompts import read_prompts
from dflash_trt.tiny.heldout import asset_dir

Case = Callable[[World, Path], list[str]]
POSITIONS = 256  # the tiny target's max_position_embeddings
LONGEST = 226  # the longest request its engine holds: 256 positions less two blocks of 15 drafts
# The longest --max_seq_len it builds with: the runtime admits requests up to max_seq_len + K (engine_lengths).
LONGEST_BUILD = LONGEST - 15
READ_ONLY = Path("/proc/dflash-hostile/out")  # procfs refuses new entries even to root


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return make_world(tmp_path_factory.mktemp("hostile_values"))


def _bench(w: World, t: Path, *extra: str, prompts: tuple[str, ...] = ("--synthetic", "4,4,2")) -> list[str]:
    """bench on the converted tiny pair into t/o; one user unless `extra` says otherwise."""
    argv = ["bench", "--checkpoint_dir", str(w.checkpoint), *prompts, "--output_dir", str(t / "o"), *extra]
    return argv if "--concurrency" in extra or "--request_rate" in extra else [*argv, "--concurrency", "1"]


def _triton_bench(url: str, w: World, t: Path) -> list[str]:
    return ["bench", "--triton_url", url, "--input_file", str(w.prompts), "--concurrency", "1", "--output_dir", str(t)]


def _generate(w: World, *extra: str) -> list[str]:
    return ["generate", "--checkpoint_dir", str(w.checkpoint), "--input_file", str(w.prompts), *extra]


def _emulate(w: World, *extra: str) -> list[str]:
    return ["emulate", "--checkpoint_dir", str(w.checkpoint), "--input_file", str(w.prompts), *extra]


def _build(w: World, t: Path, *extra: str) -> list[str]:
    return ["build", "--checkpoint_dir", str(w.checkpoint), "--output_dir", str(t / "engine"), "--dry_run", *extra]


def _file(t: Path, name: str, text: str) -> Path:
    path = t / name
    path.write_text(text)
    return path


def _sweep_with(w: World, t: Path, **changes) -> list[str]:
    config = yaml.safe_load(w.sweep.read_text()) | changes
    return ["sweep", "--config", str(_file(t, "sweep.yaml", yaml.safe_dump(config))), "--dry_run"]


def _sweep_engine_with(w: World, t: Path, **changes) -> list[str]:
    config = yaml.safe_load(w.sweep.read_text())
    config["engines"][0].update(changes)
    return ["sweep", "--config", str(_file(t, "sweep.yaml", yaml.safe_dump(config))), "--dry_run"]


def _profile_with(w: World, t: Path, section: str, **changes) -> list[str]:
    profile = yaml.safe_load(w.profile.read_text())
    profile[section].update(changes)
    path = _file(t, "profile.yaml", yaml.safe_dump(profile))
    return ["build", "--config", str(path), "--output_dir", str(t / "ws"), "--dry_run"]


def _analyze(w: World, t: Path, point: str) -> list[str]:
    config = yaml.safe_load(w.sweep.read_text()) | {"output_dir": str(t / "res")}
    (t / "res" / "ar" / "c00001").mkdir(parents=True)
    (t / "res" / "ar" / "c00001" / "point.json").write_text(point)
    return ["sweep", "--config", str(_file(t, "sweep.yaml", yaml.safe_dump(config))), "--analyze_only"]


def _convert(w: World, t: Path, *extra: str) -> list[str]:
    return ["convert", "--model_dir", str(w.target), "--dflash_model_dir", str(w.draft), *extra]


def _calibrate(w: World, t: Path, *extra: str, dataset: Path | None = None) -> list[str]:
    return [
        "convert",
        "--model_dir",
        str(w.target),
        "--dflash_model_dir",
        str(w.draft),
        "--output_dir",
        str(t / "ckpt"),
        "--qformat",
        "fp8",
        "--calib_dataset",
        str(dataset or w.prompts),
        *extra,
    ]


RANGE = r"must be an integer in \[{}, {}\], got '{}'"

# One case per probe finding (and its nearest variants): the command line and the one line it must be refused with.
REFUSED: dict[str, tuple[Case, str]] = {
    # sizes against the model (256 positions) and the machine, before anything is allocated
    "bench synthetic prompts longer than the model": (
        lambda w, t: _bench(w, t, prompts=("--synthetic", "2000,8,1")),
        rf"a request of 2000 prompt \+ 8 output tokens exceeds the target's max_position_embeddings less two draft "
        rf"blocks \({LONGEST}\)",
    ),
    "bench synthetic outputs longer than the model": (
        lambda w, t: _bench(w, t, prompts=("--synthetic", "4,1000000000,1")),
        r"--synthetic must be ISL,OSL,COUNT with ISL and OSL in \[1, 4194304\] and COUNT in \[1, 1000000\]",
    ),
    "bench a million-token synthetic prompt": (
        lambda w, t: _bench(w, t, prompts=("--synthetic", "1000000,4,1")),
        r"a request of 1000000 prompt \+ 4 output tokens exceeds the target's max_position_embeddings",
    ),
    "bench a hundred million synthetic requests": (
        lambda w, t: _bench(w, t, prompts=("--synthetic", "4,4,100000000")),
        r"COUNT in \[1, 1000000\], got '4,4,100000000'",
    ),
    "bench a billion requests": (
        lambda w, t: _bench(w, t, "--num_requests", str(10**9)),
        r"argument --num_requests: " + RANGE.format(1, 1000000, 1000000000),
    ),
    "bench a million requests of 100 tokens": (
        lambda w, t: _bench(w, t, "--num_requests", "1000000", prompts=("--synthetic", "60,40,1")),
        r"--num_requests asks for 100000000 prompt and output tokens in all; a run holds at most 50000000",
    ),
    "bench a billion users": (
        lambda w, t: _bench(w, t, "--concurrency", str(10**9)),
        r"argument --concurrency: must be a comma-separated list of distinct values, each an integer in \[1, 65536\]",
    ),
    "bench prompt file longer than the model": (
        lambda w, t: _bench(w, t, "--max_new_tokens", "300", prompts=("--input_file", str(w.prompts))),
        rf"a request of 1 prompt \+ 300 output tokens exceeds the target's max_position_embeddings less two draft "
        rf"blocks \({LONGEST}\)",
    ),
    "emulate a hundred million in flight": (
        lambda w, t: _emulate(w, "--max_batch_size", str(10**8)),
        r"argument --max_batch_size: " + RANGE.format(1, 512, 100000000),
    ),
    "emulate a megatoken KV block": (
        lambda w, t: _emulate(w, "--tokens_per_block", str(2**20)),
        r"argument --tokens_per_block: invalid choice: 1048576 \(choose from 16, 32, 64, 128\)",
    ),
    "emulate more tokens than the model has positions": (
        lambda w, t: _emulate(w, "--max_new_tokens", "1000000"),
        rf"plus --max_new_tokens 1000000 exceeds the target's max_position_embeddings less two draft blocks "
        rf"\({LONGEST}\)",
    ),
    "calibration prompts cut beyond the model": (
        lambda w, t: _calibrate(w, t, "--calib_max_seq_len", "100000"),
        r"--calib_max_seq_len must be in \[1, 256\] \(the target's max_position_embeddings\), got 100000",
    ),
    "calibration prompt plus decoded tokens beyond the model": (
        lambda w, t: _calibrate(
            w, t, "--calib_max_seq_len", "250", dataset=_file(t, "long.jsonl", json.dumps({"input_ids": [5] * 250}))
        ),
        r"a calibration prompt of 250 tokens .* exceeds the target's max_position_embeddings \(256\); give "
        r"--calib_max_seq_len 224 or less",
    ),
    # values out of range or of the wrong kind
    "demo with no prompts": (
        lambda w, t: ["demo", "--output_dir", str(t / "d"), "--num_prompts", "0"],
        r"argument --num_prompts: " + RANGE.format(1, 200, 0),
    ),
    "demo with -1 prompts": (
        lambda w, t: ["demo", "--output_dir", str(t / "d"), "--num_prompts", "-1"],
        r"argument --num_prompts: " + RANGE.format(1, 200, -1),
    ),
    "generate with stop id -1": (
        lambda w, t: _generate(w, "--stop_token_ids", "-1"),
        r"argument --stop_token_ids: " + RANGE.format(0, 2**31 - 1, -1),
    ),
    "generate with a stop id beyond the vocabulary": (
        lambda w, t: _generate(w, "--stop_token_ids", "3", "100000"),
        r"--stop_token_ids must be token ids in \[0, 127\] \(the target's vocabulary\), got 100000",
    ),
    "bench against port 99999": (
        lambda w, t: _triton_bench("127.0.0.1:99999", w, t / "o"),
        r"argument --triton_url: must be HOST:PORT with a port in \[1, 65535\], got '127\.0\.0\.1:99999'",
    ),
    "bench against a negative port": (
        lambda w, t: _triton_bench("localhost:-5", w, t / "o"),
        r"argument --triton_url: must be HOST:PORT with a port in \[1, 65535\], got 'localhost:-5'",
    ),
    "bench at an infinite request rate": (
        lambda w, t: _bench(w, t, "--request_rate", "inf"),
        r"argument --request_rate: must be a comma-separated list of distinct values, each a finite number in "
        r"\(0, 1e\+06\], got 'inf'",
    ),
    "bench with no time to finish": (
        lambda w, t: _bench(w, t, "--timeout_s", "0"),
        r"argument --timeout_s: must be a finite number in \(0, 604800\], got '0'",
    ),
    "bench with negative time": (lambda w, t: _bench(w, t, "--timeout_s", "-1"), r"argument --timeout_s: "),
    "bench with NaN time": (lambda w, t: _bench(w, t, "--timeout_s", "nan"), r"argument --timeout_s: .*got 'nan'"),
    "bench with negative warm-up": (
        lambda w, t: _bench(w, t, "--warmup", "-1"),
        r"argument --warmup: " + RANGE.format(0, 1000000, -1),
    ),
    "bench on zero GPUs": (lambda w, t: _bench(w, t, "--gpus", "0"), r"argument --gpus: " + RANGE.format(1, 1024, 0)),
    "bench with batch size 0": (
        lambda w, t: _bench(w, t, "--max_batch_size", "0"),
        r"argument --max_batch_size: " + RANGE.format(1, 65536, 0),
    ),
    "bench with a KV fraction of 7": (
        lambda w, t: _bench(w, t, "--kv_cache_free_gpu_mem_fraction", "7"),
        r"argument --kv_cache_free_gpu_mem_fraction: must be a finite number in \(0, 1\], got '7'",
    ),
    "bench with a tokenizer folder that does not exist": (
        lambda w, t: _bench(w, t, "--tokenizer_dir", str(t / "nonexistent"), prompts=("--input_file", str(w.prompts))),
        r"tokenizer folder .*nonexistent does not exist",
    ),
    "bench into a folder nothing may be created in": (
        lambda w, t: [
            "bench",
            "--checkpoint_dir",
            str(w.checkpoint),
            "--synthetic",
            "4,4,1",
            "--concurrency",
            "1",
            "--output_dir",
            str(READ_ONLY),
        ],  # fmt: skip
        r"cannot create output /proc/dflash-hostile/out",
    ),
    "convert with pp_size 0": (
        lambda w, t: _convert(w, t, "--output_dir", str(t / "ckpt"), "--pp_size", "0"),
        r"argument --pp_size: must be an integer in \[1, 1\], got '0'",
    ),
    "convert on zero GPUs": (
        lambda w, t: _convert(w, t, "--output_dir", str(t / "ckpt"), "--tp_size", "0"),
        r"argument --tp_size: " + RANGE.format(1, 1024, 0),
    ),
    "generate no tokens": (
        lambda w, t: _generate(w, "--max_new_tokens", "0"),
        r"argument --max_new_tokens: " + RANGE.format(1, 2**31 - 1, 0),
    ),
    "generate with a verify block of 0": (
        lambda w, t: _generate(w, "--block_size", "0"),
        r"argument --block_size: " + RANGE.format(1, 2**31 - 1, 0),
    ),
    "selftest with no prompts": (
        lambda w, t: ["selftest", "--output_dir", str(t / "s"), "--num_prompts", "0"],
        r"argument --num_prompts: " + RANGE.format(1, 200, 0),
    ),
    "sweep speed levels that are words": (
        lambda w, t: ["sweep", "--config", str(w.sweep), "--analyze_only", "--levels", "fast,faster"],
        r"argument --levels: must be a comma-separated list of distinct values, each a finite number in \(0, 1e\+09\]",
    ),
    # build: passthrough flags that would override checked values
    "build passthrough of the output folder": (
        lambda w, t: _build(w, t, "--", "--output_dir", "/etc"),
        r"the trtllm-build flag --output_dir after `--` would override --output_dir, which dflash-trt build sets",
    ),
    "build passthrough of the batch size": (
        lambda w, t: _build(w, t, "--", "--max_batch_size=9999"),
        r"flag --max_batch_size after `--` would override --max_batch_size",
    ),
    "build passthrough of the speculative mode": (
        lambda w, t: _build(w, t, "--", "--speculative_decoding_mode", "none"),
        r"flag --speculative_decoding_mode after `--` would override",
    ),
    "build passthrough of an abbreviation": (
        lambda w, t: _build(w, t, "--", "--max_batch", "9999"),
        r"flag --max_batch after `--` would override --max_batch_size",
    ),
    "build passthrough of an alias": (
        lambda w, t: _build(w, t, "--", "--max_decoder_seq_len", "9999"),
        r"flag --max_decoder_seq_len after `--` would override --max_decoder_seq_len",
    ),
    "build passthrough of a whole build config": (
        lambda w, t: _build(w, t, "--", "--build_config", "b.json"),
        r"flag --build_config after `--` would override --build_config",
    ),
    "build with batch size 0": (
        lambda w, t: _build(w, t, "--max_batch_size", "0"),
        r"argument --max_batch_size: " + RANGE.format(1, 512, 0),
    ),
    "build longer than the model": (
        lambda w, t: _build(w, t, "--max_seq_len", "512"),
        r"max_seq_len 512 lets the executor run requests of 527 tokens .* reaches position 556, past the 256 rows .* "
        r"--max_seq_len <= 211",
    ),
    # build profiles
    "profile batch size true": (
        lambda w, t: _profile_with(w, t, "engine", max_batch_size=True),
        r"engine\.max_batch_size: Input should be a valid integer",
    ),
    "profile switch as a string": (
        lambda w, t: _profile_with(w, t, "engine", use_fp8_context_fmha="false"),
        r"engine\.use_fp8_context_fmha: Input should be a valid boolean",
    ),
    "profile with two engine sections": (
        lambda w, t: [
            "build",
            "--config",
            str(_file(t, "p.yaml", w.profile.read_text() + "engine:\n  max_batch_size: 2\n")),
            "--dry_run",
        ],
        r"the key 'engine' is given twice in one mapping",
    ),
    # sweep configs, refused even with --dry_run
    "sweep seed abc": (lambda w, t: _sweep_with(w, t, seed="abc"), r"'seed' must be an integer in \[0, "),
    "sweep output_dir 5": (lambda w, t: _sweep_with(w, t, output_dir=5), r"'output_dir' must be a non-empty string"),
    "sweep timeout soon": (
        lambda w, t: _sweep_with(w, t, timeout_s="soon"),
        r"'timeout_s' must be a finite number in \(0, 604800\], got 'soon'",
    ),
    "sweep warmup lots": (lambda w, t: _sweep_with(w, t, warmup="lots"), r"'warmup' must be an integer in \[0, "),
    "sweep KV fraction 7": (
        lambda w, t: _sweep_with(w, t, kv_cache_free_gpu_mem_fraction=7),
        r"'kv_cache_free_gpu_mem_fraction' must be a finite number in \(0, 1\], got 7",
    ),
    "sweep streaming as a string": (
        lambda w, t: _sweep_with(w, t, streaming="false"),
        r"'streaming' must be true or false, got 'false'",
    ),
    "sweep engine end_id abc": (
        lambda w, t: _sweep_engine_with(w, t, end_id="abc"),
        r"engine 'ar': 'end_id' must be an integer in \[-1, 2147483647\], got 'abc'",
    ),
    "sweep engine on port 99999": (
        lambda w, t: _sweep_engine_with(w, t, engine_dir=None, triton_url="h:99999"),
        r"engine 'ar': 'triton_url' must be HOST:PORT with a port in \[1, 65535\]",
    ),
    "sweep config with two equal keys": (
        lambda w, t: ["sweep", "--config", str(_file(t, "s.yaml", w.sweep.read_text() + "seed: 1\nseed: 2\n"))],
        r"the key 'seed' is given twice",
    ),
    # sweep --analyze_only over point records it cannot use
    "analyze a point that is a list": (lambda w, t: _analyze(w, t, "[1]"), r"point\.json must hold a JSON object"),
    "analyze a point without fields": (lambda w, t: _analyze(w, t, '{"engine": "ar"}'), r"'kind' must be one of"),
    "analyze a point with a word for a number": (
        lambda w, t: _analyze(
            w, t, json.dumps({"engine": "ar", "kind": "ar", "concurrency": 1, "status": "ok", "tok_s_gpu": "fast"})
        ),
        r"point\.json: 'tok_s_gpu' must be a finite number in \[0, 1e\+12\], got 'fast'",
    ),
    "analyze a truncated point": (lambda w, t: _analyze(w, t, '{"engine": "ar", "ki'), r"is not valid JSON"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_hostile_value_is_refused_cleanly(world: World, tmp_path: Path, capsys, case: str) -> None:
    make_argv, message = REFUSED[case]
    argv = make_argv(world, tmp_path)
    before = snapshot(world.root, asset_dir(), tmp_path)
    code, out, err = run_cli(argv, capsys)
    assert_refused(code, err, argv[0], message)
    assert out == ""
    assert snapshot(world.root, asset_dir(), tmp_path) == before
    assert not READ_ONLY.exists()


def _user_folder(root: Path) -> Path:
    root.mkdir()
    (root / "thesis.tex").write_text("years of work")
    (root / "data").mkdir()
    (root / "data" / "runs.csv").write_text("1,2,3\n")
    return root


def test_bench_overwrite_never_deletes_the_users_files(world: World, tmp_path: Path, capsys) -> None:
    """`bench --output_dir . --overwrite` from a folder of the user's files: refused before measuring, nothing lost."""
    home = _user_folder(tmp_path / "home")
    before = snapshot(home)
    cwd = os.getcwd()
    os.chdir(home)
    try:
        code, _, err = run_cli(
            ["bench", "--checkpoint_dir", str(world.checkpoint), "--synthetic", "4,4,2", "--concurrency", "1",
             "--output_dir", ".", "--overwrite"], capsys)  # fmt: skip
    finally:
        os.chdir(cwd)
    assert_refused(
        code, err, "bench", rf"holds files dflash-trt did not write \(no {OUTPUT_MARKER}\); --overwrite only"
    )
    assert snapshot(home) == before and sorted(os.listdir(tmp_path)) == ["home"]


def test_bench_overwrite_replaces_its_own_results(world: World, tmp_path: Path, capsys) -> None:
    argv = _bench(world, tmp_path, "--json")
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "o" / OUTPUT_MARKER).read_text()) == {"written_by": "dflash-trt bench"}
    first = json.loads((tmp_path / "o" / "results.json").read_text())
    code, _, err = run_cli(argv, capsys)
    assert_refused(code, err, "bench", r"already exists; pass --overwrite")
    code, _, err = run_cli([*argv, "--overwrite"], capsys)
    assert code == 0, err
    second = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [p["per_request"][0]["output_ids"] for p in second["points"]] == [
        p["per_request"][0]["output_ids"] for p in first["points"]
    ]
    # Another command's output is not bench's to replace.
    (tmp_path / "o" / OUTPUT_MARKER).write_text(json.dumps({"written_by": "dflash-trt convert"}))
    code, _, err = run_cli([*argv, "--overwrite"], capsys)
    assert_refused(code, err, "bench", r"was written by dflash-trt convert; --overwrite only replaces an earlier")


def test_convert_publishes_the_longest_legal_output_name(world: World, tmp_path: Path, capsys) -> None:
    name = "c" * 245
    code, _, err = run_cli(_convert(world, tmp_path, "--output_dir", str(tmp_path / name)), capsys)
    assert code == 0, err
    assert (tmp_path / name / "rank0.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == [name]


def test_build_defaults_max_seq_len_to_what_the_models_positions_allow(world: World, tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(["build", "--checkpoint_dir", str(world.checkpoint), "--output_dir",
                              str(tmp_path / "e"), "--dry_run", "--json"], capsys)  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["build_config"]["max_seq_len"] == LONGEST_BUILD  # min(8192, max_position_embeddings - 3K)
    assert plan["build_config"]["max_input_len"] == LONGEST_BUILD  # min(4096, max_seq_len)
    command = plan["command"]
    assert command[command.index("--max_seq_len") + 1] == str(LONGEST_BUILD)
    code, out, err = run_cli(
        ["build", "--checkpoint_dir", str(world.checkpoint), "--output_dir", str(tmp_path / "e"), "--dry_run",
         "--json", "--max_seq_len", "128"], capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["build_config"]["max_input_len"] == 128


def test_build_passes_flags_it_does_not_set(world: World, tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(_build(world, tmp_path, "--json", "--", "--log_level", "verbose", "--strip_plan"), capsys)
    assert code == 0, err
    assert json.loads(out)["command"][-3:] == ["--log_level", "verbose", "--strip_plan"]


def test_build_config_dry_run_json_prints_only_json(world: World, tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(
        ["build", "--config", str(world.profile), "--output_dir", str(tmp_path / "ws"), "--dry_run", "--json"], capsys
    )
    assert code == 0, err
    stages = json.loads(out)["stages"]
    assert [s["stage"] for s in stages] == ["checkpoint", "engine", "triton"]
    assert all(s["outcome"].startswith("would run") for s in stages)
    assert "[1/3] checkpoint" in err


def test_prompt_lines_may_hold_unicode_line_separators(world: World, tmp_path: Path, capsys) -> None:
    """U+2028 and U+0085 are legal inside a JSON string; only "\\n" ends a line."""
    text = "add 0012 0034\u2028\u0085"
    prompts = _file(tmp_path, "p.jsonl", json.dumps({"text": text}, ensure_ascii=False) + "\n")
    argv = ["generate", "--checkpoint_dir", str(world.checkpoint), "--input_file", str(prompts), "--json"]
    code, out, err = run_cli([*argv, "--max_new_tokens", "2"], capsys)
    assert code == 0, err
    assert len(json.loads(out)["sequences"]) == 1


def test_prompts_read_from_a_pipe(tmp_path: Path) -> None:
    """`--input_file /dev/stdin` (a pipe, not a regular file) is read like a file."""
    fifo = tmp_path / "stdin"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w", encoding="utf-8") as pipe:
            pipe.write('{"input_ids": [1, 2, 3]}\n{"input_ids": [4]}\n')

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        assert read_prompts(fifo) == [[1, 2, 3], [4]]
    finally:
        writer.join(timeout=10)


def test_a_huge_prompt_is_one_line_on_stderr(world: World, tmp_path: Path, capsys) -> None:
    prompts = _file(tmp_path, "big.jsonl", json.dumps({"text": "add 0012 0034 " * 400_000}) + "\n")
    code, _, err = run_cli(
        ["generate", "--checkpoint_dir", str(world.checkpoint), "--input_file", str(prompts)], capsys
    )
    assert_refused(code, err, "generate", r"the longest prompt \(\d+ tokens\) plus --max_new_tokens 64 exceeds")


def test_a_failing_cpu_executor_ends_the_run_instead_of_hanging(world: World, tmp_path: Path, capsys, monkeypatch):
    """Every step of the executor fails (here: out of memory); each request fails and the run ends at once."""
    from dflash_trt.executors.golden import GoldenStepper

    def no_memory(self):
        raise MemoryError("cannot allocate 1 TB")

    monkeypatch.setattr(GoldenStepper, "step", no_memory)
    code, out, err = run_cli(_bench(world, tmp_path, "--json", "--timeout_s", "60"), capsys)
    # Every request failed: the results are written, then bench says so and exits 2.
    assert code == 2 and err.splitlines()[-1].endswith("failed: the executor failed: cannot allocate 1 TB"), err
    (point,) = json.loads(out)
    assert point["requests"] == 0 and point["failed"] == 2
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    errors = {r["error"] for r in results["points"][0]["per_request"]}
    assert errors == {"the executor failed: cannot allocate 1 TB"}


@pytest.mark.parametrize("sampling", ["engine", "reference"])
def test_generate_at_a_vanishing_temperature_decodes_greedily(world: World, capsys, sampling: str) -> None:
    """The one temperature rule (`sampling_rules`): a temperature too small to invert decodes as temperature 0, in
    `generate` as in every other path, whichever acceptance rule."""
    outputs = []
    for temperature in ("0", "1e-45"):
        code, out, err = run_cli(
            _generate(world, "--json", "--temperature", temperature, "--sampling", sampling), capsys
        )
        assert code == 0, err
        outputs.append([s["output_ids"] for s in json.loads(out)["sequences"]])
    assert outputs[0] == outputs[1]


def _clipped(acceptance: list[int], budget: int) -> list[int]:
    """A full-block run's acceptance lengths as an engine reports them: steps until `budget` tokens, the last cut."""
    kept: list[int] = []
    for produced in acceptance:
        if budget <= 0:
            break
        kept.append(min(produced, budget))
        budget -= kept[-1]
    return kept


def test_emulate_is_the_engines_contract_near_max_new_tokens(world: World, tmp_path: Path, capsys) -> None:
    """The probe's case: the shipped pair at 13 new tokens, where `generate` shrinks its last block and the engine
    drafts a full one and clips. The engine's acceptance is the golden loop's run block_size - 1 tokens further,
    clipped to the budget (`emulate --help`); plain `generate` agrees on every token, not on every length."""
    from dflash_trt.tiny.heldout import load_heldout

    prompts = _file(tmp_path, "p.jsonl", "".join(json.dumps({"text": p.text}) + "\n" for p in load_heldout(limit=13)))
    args = ["--checkpoint_dir", str(world.checkpoint), "--input_file", str(prompts), "--json"]
    block = 16
    runs = {}
    for name, argv in {
        "generate": ["generate", *args, "--max_new_tokens", "13"],
        "generate_further": ["generate", *args, "--max_new_tokens", str(13 + block - 1)],
        "emulate": ["emulate", *args, "--max_new_tokens", "13", "--max_batch_size", "8"],
    }.items():
        code, out, err = run_cli(argv, capsys)
        assert code == 0, err
        runs[name] = json.loads(out)["sequences"]
    shrunk = 0
    for plain, further, engine in zip(runs["generate"], runs["generate_further"], runs["emulate"], strict=True):
        assert engine["output_ids"] == plain["output_ids"] == further["output_ids"][:13]
        # the first token comes from the context step; the budget left for verify steps is 12
        assert engine["acceptance_lengths"] == _clipped(further["acceptance_lengths"], 12)
        shrunk += plain["acceptance_lengths"] != engine["acceptance_lengths"]
    assert shrunk > 0  # the shortened last block really changes drafts (4 of these 13 prompts)


def _open_loop_point(rate: float) -> dict:
    return {"mode": "ar", "concurrency": None, "request_rate": rate, "throughput_tok_s": 10.0,
            "tpot_s": {"p50": 0.01}, "acceptance_length": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (
            [_open_loop_point(2.0), _open_loop_point(4.0)],
            r"holds only open-loop points \(bench --request_rate\); calibration fits closed-loop points",
        ),
        ([_open_loop_point(1.0)] * 100_001, r"'points' must hold at most 1000 points .*got 100001"),
    ],
)
def test_plan_calibrate_refuses_what_it_cannot_fit(tmp_path: Path, capsys, points: list, message: str) -> None:
    results = _file(tmp_path, "results.json", json.dumps({"format": "dflash-trt-bench/1", "points": points}))
    code, out, err = run_cli(["plan", "--preset", "qwen3-8b", "--calibrate", str(results)], capsys)
    assert_refused(code, err, "plan", message)
    assert out == ""


def test_selftest_without_tensorrt_llm_suggests_what_exists(tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["selftest", "--output_dir", str(tmp_path / "s")], capsys)
    assert_refused(code, err, "selftest", r"not installed here; .*\(on a CPU, dflash-trt emulate runs the engine")
    assert "--dry_run" not in err and not (tmp_path / "s").exists()


def test_an_unresponsive_triton_server_is_named_with_a_reason() -> None:
    """A server that accepts the connection and never answers: the refusal says what happened, not ': '."""
    import asyncio
    import socket

    from dflash_trt.clients.triton import TritonExecutor
    from dflash_trt.errors import DFlashTrtError

    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        backend = TritonExecutor(f"127.0.0.1:{port}", connect_timeout_s=0.5)
        with pytest.raises(DFlashTrtError, match=rf"cannot reach a Triton server at 127\.0\.0\.1:{port}: no answer "
                           r"within 0\.5 s$"):  # fmt: skip
            asyncio.run(backend.start(lambda batch: None))


def test_a_new_numeric_flag_is_range_checked_by_construction() -> None:
    """A flag typed plain `int` / `float` accepts -1, 10**12, inf and nan; it must take a rule (or choices)."""
    import argparse

    from dflash_trt.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    unchecked = {
        (name, action.option_strings[0])
        for name, parser in commands.choices.items()
        for action in parser._actions
        if action.type in (int, float) and action.choices is None
    }
    assert unchecked == set()
