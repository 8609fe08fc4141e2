"""Chat prompts everywhere a prompt enters: `{"messages": [...]}` lines rendered with the tokenizer's own chat
template (enable_thinking false by default, as the Qwen3 DFlash drafters were trained), checked against the
template rendered directly with jinja2; and the tokenizer's length warning kept out of our output."""

from __future__ import annotations

import json

import jinja2
import pytest

from dflash_trt.cli import main
from dflash_trt.conversion.convert import convert_checkpoint
from dflash_trt.errors import DFlashTrtError
from dflash_trt.prompts import read_prompts
from dflash_trt.tiny.heldout import draft_dir, load_heldout, target_dir
from dflash_trt.tokenizer import load_tokenizer
from dflash_trt.triton.processing import Preprocessor

# A Qwen3-style template in miniature: the thinking switch closes an empty think block when thinking is off.
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "add 0012 0034"}]


def _with_template(directory):
    config = directory / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"chat_template": TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "ckpt"
    convert_checkpoint(target_dir(), draft_dir(), path, dtype="float32")
    return _with_template(path)


def _expected_ids(tokenizer, **kwargs) -> list[int]:
    text = jinja2.Environment().from_string(TEMPLATE).render(messages=CHAT, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt_file(tmp_path, *records):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_messages_render_with_thinking_off_unless_asked(chat_checkpoint, tmp_path):
    tokenizer = load_tokenizer(chat_checkpoint)
    path = _prompt_file(tmp_path, {"messages": CHAT}, {"text": "add 0001 0002\n"})
    default, plain = read_prompts(path, tokenizer)
    assert default == _expected_ids(tokenizer, enable_thinking=False)
    assert plain == tokenizer.encode("add 0001 0002\n")
    (thinking, _) = read_prompts(path, tokenizer, chat_kwargs={"enable_thinking": True})
    assert thinking == _expected_ids(tokenizer, enable_thinking=True) != default
    assert "<think>" not in tokenizer.decode(thinking)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, 'every message must be {"role"'),
        ({"messages": CHAT, "text": "x"}, "more than one of input_ids, text, messages"),
    ],
)
def test_malformed_chats_are_one_clear_error(chat_checkpoint, tmp_path, record, message):
    with pytest.raises(DFlashTrtError, match="prompts.jsonl:1") as raised:
        read_prompts(_prompt_file(tmp_path, record), load_tokenizer(chat_checkpoint))
    assert message in str(raised.value)


def test_a_tokenizer_without_a_template_refuses_messages(tmp_path):
    untemplated = load_tokenizer(target_dir())
    untemplated.chat_template = None
    with pytest.raises(DFlashTrtError, match="has no chat template; send plain text"):
        read_prompts(_prompt_file(tmp_path, {"messages": CHAT}), untemplated)


def test_the_tiny_pairs_own_template_renders_a_user_message_as_its_problem_line(tmp_path):
    """The shipped template against jinja2 directly: a user message is the problem line the pair was trained on."""
    tokenizer = load_tokenizer(target_dir())
    text = load_heldout(limit=1)[0].text
    [ids] = read_prompts(_prompt_file(tmp_path, {"messages": [{"role": "user", "content": text.strip()}]}), tokenizer)
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_generate_and_bench_take_chat_template_kwargs(chat_checkpoint, tmp_path, capsys):
    tokenizer = load_tokenizer(chat_checkpoint)
    prompts = _prompt_file(tmp_path, {"messages": CHAT})
    common = ["--checkpoint_dir", str(chat_checkpoint), "--input_file", str(prompts), "--max_new_tokens", "4"]
    kwargs = ["--chat_template_kwargs", '{"enable_thinking": true}']
    assert main(["generate", *common, *kwargs, "--json"]) == 0
    (sequence,) = json.loads(capsys.readouterr().out)["sequences"]
    assert sequence["input_ids"] == _expected_ids(tokenizer, enable_thinking=True)
    out = tmp_path / "bench"
    assert main(["bench", *common, "--concurrency", "1", "--output_dir", str(out)]) == 0
    (point,) = json.loads((out / "results.json").read_text())["points"]
    assert point["per_request"][0]["input_len"] == len(_expected_ids(tokenizer, enable_thinking=False))
    capsys.readouterr()
    assert main(["generate", *common, "--chat_template_kwargs", "[1]"]) == 2
    assert "--chat_template_kwargs must be a JSON object" in capsys.readouterr().err


def test_triton_preprocessing_renders_chat_queries(chat_checkpoint):
    tokenizer = load_tokenizer(chat_checkpoint)
    params = {"tokenizer_dir": str(chat_checkpoint), "add_special_tokens": "true", "max_input_len": "256",
              "max_seq_len": "257", "max_temperature": "inf", "chat_template_kwargs": "{}"}  # fmt: skip
    pre = Preprocessor.from_parameters(params)
    ids, lengths = pre.encode([json.dumps({"messages": CHAT}), "add 0001 0002\n"])
    expected = _expected_ids(tokenizer, enable_thinking=False)
    assert ids[0, : len(expected)].tolist() == expected and lengths[0, 0] == len(expected)
    assert lengths[1, 0] == len(tokenizer.encode("add 0001 0002\n"))
    thinking = Preprocessor.from_parameters(params | {"chat_template_kwargs": '{"enable_thinking": true}'})
    assert thinking.encode([json.dumps({"messages": CHAT})])[1][0, 0] == len(
        _expected_ids(tokenizer, enable_thinking=True)
    )


def test_long_prompts_do_not_print_the_tokenizers_length_warning(tmp_path, capfd):
    text = "".join(p.text for p in load_heldout(limit=40))
    tokenizer = load_tokenizer(target_dir())
    (ids,) = read_prompts(_prompt_file(tmp_path, {"text": text}), tokenizer)
    configured = json.loads((target_dir() / "tokenizer_config.json").read_text())["model_max_length"]
    assert len(ids) > configured  # long enough that transformers would warn
    captured = capfd.readouterr()
    assert "Token indices sequence length" not in captured.out + captured.err


def test_triton_refuses_chat_template_kwargs_that_are_no_json_object(tmp_path, capsys):
    argv = ["triton", "--engine_dir", str(tmp_path / "e"), "--tokenizer_dir", str(target_dir()),
            "--output_dir", str(tmp_path / "r"), "--chat_template_kwargs", "[true]"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chat_template_kwargs must be a JSON object" in err[0]
    assert not (tmp_path / "r").exists()
