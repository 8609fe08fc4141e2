"""Character-level `tokenizer.json` for the tiny pair, built with the `tokenizers` library.

One token per printable ASCII character keeps the vocabulary tiny and makes every digit its own token,
which is what lets a small model do column arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, UNK_TOKEN)
CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))
MODEL_MAX_LENGTH = 256
# The pair is trained on one problem per sequence ("add 12 34\n" then the answer and EOS), so a chat renders each
# user message as a problem line and each assistant message as its answer; other roles have no place in it.
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ m.content | trim }}{{ '\n' }}"
    "{%- elif m.role == 'assistant' %}{{ m.content | trim }}{{ eos_token }}"
    "{%- else %}{{ raise_exception('the tiny pair takes user and assistant messages, not ' ~ m.role) }}"
    "{%- endif %}{%- endfor %}"
)


def vocabulary() -> dict[str, int]:
    """Special tokens first (EOS = 0, MASK = 1), then one id per character."""
    return {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE model with no merges is exactly a character tokenizer; Fuse joins characters back on decode."""
    backend = Tokenizer(models.BPE(vocab=vocabulary(), merges=[], unk_token=UNK_TOKEN))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) loadable by AutoTokenizer.

    The class is recorded as PreTrainedTokenizerFast, which every transformers release since 4.x resolves.
    """
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(directory))
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tokenizer
