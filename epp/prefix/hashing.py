"""Chained block hashes of a prompt, the keys of the approximate prefix index.

A prompt is cut into fixed-size blocks and each block's hash is seeded with the previous one, so
a hash names the block *and everything before it*, like an engine's KV block. Two requests
share their first ``k`` hashes exactly when they share their first ``k`` blocks, and a later chat
turn (whose text starts with the earlier turns, see :mod:`epp.request`) repeats the hashes of
the turns before it.

- Text prompts: blocks of ``block_chars`` UTF-8 bytes (GIE: 4 characters per token x 16-token
  blocks = 64). Bytes rather than characters because bytes track tokens better across scripts:
  64 bytes of English are ~16 tokens, and so are 64 bytes of CJK text (~21 characters of 3 bytes),
  whereas 64 CJK characters would be ~64 tokens.
- Token prompts: blocks of ``block_size`` token ids, hashed as 4-byte unsigned integers.

The chain starts from a seed derived from the model and LoRA adapter, so the same text under
another model or adapter never matches (an engine caches them separately too). Only full blocks
are hashed, as engines cache only full blocks, and at most ``max_blocks`` leading ones: the
match is a prefix, and capping bounds the work on huge prompts.

Speed matters (a 32k-token prompt must not cost a millisecond): the prompt's prefix is encoded
once, cut into ``bytes`` blocks by ``struct``'s C loop (``iter_unpack`` of ``"<n>s"``: no
Python-level slicing per block, and a 64-byte copy is cheaper than making a memoryview), and
chaining passes the previous hash as xxh64's seed instead of concatenating it to the block.
"""

from __future__ import annotations

import functools
import struct
from array import array
from dataclasses import dataclass

from xxhash import xxh64_intdigest

from epp.request import CHARS_PER_TOKEN, InferenceRequest

DEFAULT_BLOCK_CHARS = 64
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BLOCKS = 256
# Token ids are hashed as unsigned 32-bit integers (array type "I").
_TOKEN_BYTES = 4


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """How prompts are cut into blocks; plugins sharing an index must use equal hashers."""

    block_chars: int = DEFAULT_BLOCK_CHARS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_blocks: int = DEFAULT_MAX_BLOCKS

    def __post_init__(self) -> None:
        for name in ("block_chars", "block_size", "max_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def tokens_per_block(self, request: InferenceRequest) -> int:
        """Prompt tokens one block stands for (estimated for text, as in ``prompt_tokens``)."""
        if request.prompt_token_ids is not None:
            return self.block_size
        return max(1, self.block_chars // CHARS_PER_TOKEN)

    def hashes(self, request: InferenceRequest) -> list[int]:
        """The chained hashes of the request's leading full blocks (at most ``max_blocks``)."""
        seed = _seed(request.model, request.lora)
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids[: self.max_blocks * self.block_size]
            try:
                # Native byte order: little-endian on every platform epp runs on, so processes
                # sharing an index agree.
                data = array("I", ids).tobytes()
            except OverflowError:
                return []  # ids outside 0..2**32-1 are no vocabulary's; the engine rejects them
            step = self.block_size * _TOKEN_BYTES
        else:
            # Every character is at least one byte, so this many characters cover the bytes
            # needed. JSON may carry lone surrogates ("\ud800"); they must not fail a request.
            data = request.prompt[: self.max_blocks * self.block_chars].encode(
                "utf-8", "surrogatepass"
            )
            step = self.block_chars
        end = min(len(data) // step, self.max_blocks) * step
        h = seed
        return [
            h := xxh64_intdigest(block, h) for (block,) in _blocks(step).iter_unpack(data[:end])
        ]


@functools.lru_cache(maxsize=1024)
def _seed(model: str, lora: str | None) -> int:
    """The chain's seed for ``model`` and adapter (the configured ones: a bounded cache)."""
    return xxh64_intdigest(f"{model}\x00{lora or ''}".encode())


@functools.cache
def _blocks(step: int) -> struct.Struct:
    """Unpacks one ``step``-byte block as a ``bytes`` object."""
    return struct.Struct(f"{step}s")
