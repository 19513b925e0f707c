"""A checkpoint's tokenizer: HF `tokenizer.json`, EOS ids and its chat template.

Stop tokens follow vLLM: `generation_config.json`'s `eos_token_id` (an id or a list)
over config.json's. The chat template is rendered with Jinja2 as transformers does.
(Harmony chat for o200k gpt-oss checkpoints arrives with the server.)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


@dataclass
class CheckpointTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special: dict[str, str]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}), **self.special)

    def encode_chat(self, user_text: str) -> list[int]:
        return self.encode(self.render_chat([{"role": "user", "content": user_text}]))


def load_tokenizer(model_dir: str | Path) -> CheckpointTokenizer:
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; the checkpoint needs an HF tokenizer.json")
    gen = _read_json(model_dir / "generation_config.json")
    cfg = _read_json(model_dir / "config.json")
    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    eos = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    special = {k: v for k, v in tok_cfg.items()
               if k in ("bos_token", "eos_token", "pad_token", "unk_token") and isinstance(v, str)}
    return CheckpointTokenizer(Tokenizer.from_file(str(path)), eos, tok_cfg.get("chat_template"),
                               special)
