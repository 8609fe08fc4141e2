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
