"""Tokenizers: a Hugging Face tokenizer.json through `tokenizers`, plus the built-in byte-level one."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

# A plain chat template for models without one: role-tagged turns, then the assistant's cue. With
# tools, a system turn lists them and asks for Hermes-style calls (router/tools.py parses those);
# an assistant turn's calls are written back the same way. Rendered as HF transformers renders
# templates (blocks trimmed: a line break right after a block tag is dropped, hence {{ "\n" }}).
PLAIN_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou can call these functions. To call one, answer with <tool_call>{\"name\": "
    "<its name>, \"arguments\": <an object>}</tool_call>, once per call.\n"
    "{% for t in tools %}{{ t | tojson }}{{ \"\\n\" }}{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{{ \"\\n\" }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None = None):
        self._tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        self._max_token_chars: int | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """The longest token's length in characters (of its vocabulary entry: a byte-level or
        SentencePiece piece covers at most that many characters of the text), so that a text of
        more than `max_token_chars` x N characters surely encodes to more than N tokens: a
        prompt far past the context can be refused before it is tokenized."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what the grammar engine reads)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        return cls(tok, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")),
                   cfg.get("chat_template"))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self._tok.save(str(path / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
               "eos_token": self.eos_token, "pad_token": self.eos_token,
               "model_max_length": 4096, "clean_up_tokenization_spaces": False}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):                    # {"content": "<s>", ...} in older configs
        return tok.get("content")
    return tok


@lru_cache(maxsize=1)
def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, as ByteLevel pre-tokenization emits."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_level_tokenizer() -> Tokenizer:
    """The built-in models' tokenizer: one token per UTF-8 byte (ids 0-255) plus <s>, </s>."""
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    vocab["<s>"], vocab["</s>"] = 256, 257
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(tok, "<s>", "</s>", PLAIN_CHAT_TEMPLATE)
