"""`dflash-trt serve` refuses bad flags and targets with one line and exit 2, before it listens."""

from __future__ import annotations

import pytest
from _hostile_cli import run_cli

from dflash_trt.cli import main

CASES = [
    (["--port", "70000"], "argument --port: must be an integer in [0, 65535], got '70000'"),
    (["--max_queue_size", "-1"], "argument --max_queue_size: must be an integer in [0, 1000000], got '-1'"),
    (["--max_request_bytes", "10"], "argument --max_request_bytes: must be an integer in [1024, 2147483647]"),
    (["--drain_timeout_s", "0"], "argument --drain_timeout_s: must be an integer in [1, 604800], got '0'"),
    (["--max_batch_size", "0"], "argument --max_batch_size: must be an integer in [1, 512], got '0'"),
    (["--max_seq_len", "100000"], "--max_seq_len must be <= 226: the target's max_position_embeddings (256) less"),
    (["--max_seq_len", "227"], "less two draft blocks of 15, which the engine's last step reaches past a request's"),
    (["--api_key", ""], "--api_key is empty: give a key, or leave it out to serve without one"),
    (["--api_key", "s\u00e9same"], "--api_key must be printable ASCII without spaces"),
    (["--api_key", "open sesame"], "--api_key must be printable ASCII without spaces"),
    (["--api_key", "k", "--allowed_hosts", "a.lan"], "--allowed_hosts applies to a server on loopback without"),
    (["--host", "0.0.0.0", "--allowed_hosts", "a.lan"], "--allowed_hosts applies to a server on loopback without"),
    (["--draft_tree", "0"], "argument --draft_tree: must be an integer in [1, 4096], got '0'"),
    (["--draft_tree", "10"], "draft_tree 10: a tree holds at least the chain's 15 drafts"),
    (["--draft_tree", "257"], "draft_tree 257: an EAGLE engine verifies at most 256 drafts"),
    # A tree's nodes sit at most 15 positions deep: the chain's bound, not one of 40 positions.
    (["--draft_tree", "40", "--max_seq_len", "227"], "--max_seq_len must be <= 226: the target's"),
    (["--header_timeout_s", "0"], "argument --header_timeout_s: must be a finite number in (0, 604800], got '0'"),
]


@pytest.mark.parametrize(("extra", "message"), CASES, ids=[c[1] for c in CASES])
def test_bad_flags_are_one_clear_error(tiny, capsys, extra, message):
    code, _, err = run_cli(["serve", "--checkpoint_dir", str(tiny), *extra], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_targets_without_what_they_need_are_refused(tiny, tmp_path, capsys):
    assert main(["serve", "--triton_url", "127.0.0.1:1"]) == 2
    assert "--engine_dir and --triton_url need --tokenizer_dir" in capsys.readouterr().err
    assert main(["serve", "--triton_url", "127.0.0.1:1", "--tokenizer_dir", str(tiny)]) == 2
    assert "--triton_url needs --max_seq_len" in capsys.readouterr().err
    assert main(["serve", "--checkpoint_dir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer folder" in err and "does not exist" in err
    assert main(["serve", "--engine_dir", str(tmp_path), "--tokenizer_dir", str(tiny)]) == 2
    assert "holds no engine" in capsys.readouterr().err
    assert main(["serve", "--engine_dir", str(tmp_path), "--tokenizer_dir", str(tiny), "--draft_tree", "40"]) == 2
    assert "--draft_tree applies to --checkpoint_dir" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["", "\u00e9"])
def test_an_unusable_key_in_the_environment_is_refused_too(tiny, capsys, monkeypatch, value):
    monkeypatch.setenv("DFLASH_TRT_API_KEY", value)
    assert main(["serve", "--checkpoint_dir", str(tiny)]) == 2
    assert "DFLASH_TRT_API_KEY" in capsys.readouterr().err
