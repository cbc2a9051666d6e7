"""Tokenizer: the checkpoint's `tokenizer.json` (HF `tokenizers`) plus its chat template (jinja2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(file))
        config_file = path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token_ids = self._eos_ids(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _eos_ids(self, path: Path) -> tuple[int, ...]:
        ids: list[int] = []
        generation = path / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
        eos_token = self.config.get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        if isinstance(eos_token, str) and self._tok.token_to_id(eos_token) is not None:
            ids.append(self._tok.token_to_id(eos_token))
        return tuple(dict.fromkeys(int(i) for i in ids))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}]) with the checkpoint's template (ChatML when it has none)."""
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template or CHATML_TEMPLATE)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.config.get("bos_token") or "",
            eos_token=self.config.get("eos_token") or "",
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer(path)
