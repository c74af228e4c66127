"""The simulated model's tokenizer: the bundled BPE (or --tokenizer DIR), chat rendering and
deterministic filler output tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from epp.sim import chat_template

BUNDLED_DIR = Path(__file__).parent / "tokenizer"
# Texts at least this long are tokenized in a worker thread.
OFFLOAD_CHARS = 16384


@dataclass
class SimTokenizer:
    directory: Path
    tokenizer: Tokenizer = field(init=False)
    bos_token: str = field(init=False)
    filler: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.directory = self.directory.resolve()
        self.tokenizer = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        config = json.loads((self.directory / "tokenizer_config.json").read_text())
        bos = config.get("bos_token") or ""
        self.bos_token = bos["content"] if isinstance(bos, dict) else bos
        self.filler = self._filler_ids()

    def _filler_ids(self) -> list[int]:
        """Word-like vocab entries (" name"): generated text looks like text, never specials."""
        vocab = self.tokenizer.get_vocab()
        words = sorted(i for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha())
        return words or sorted(vocab.values())

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode() off the event loop for long texts: tokenizing a 200 KB prompt takes tens
        of ms, which would stall every replica sharing the loop (the Rust tokenizer releases
        the GIL). Short texts stay inline, where a thread hop would cost more than it saves."""
        if len(text) < OFFLOAD_CHARS:
            return self.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool) -> str:
        return chat_template.render(messages, self.bos_token, add_generation_prompt)

    def encode_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> list[int]:
        """Chat prompts carry BOS in the template, so no special tokens are added (as vLLM)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    async def encode_chat_async(
        self, messages: Sequence[Any], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt)
        return await self.encode_async(text, add_special_tokens=False)

    def filler_token(self, prompt: Sequence[int], index: int) -> int:
        """Output token `index` for a prompt: deterministic, varies with the prompt.

        Called once per generated token, so the seed is cheap arithmetic, not a hash.
        """
        seed = len(prompt) * 2654435761 + sum(prompt[-16:])
        return self.filler[(seed + index * 7919) % len(self.filler)]
