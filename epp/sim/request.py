"""One inference request as the simulated engine sees it."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from epp.sim.kv_cache import external_hash, hash_block_digests, lora_extra_keys


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    """Token state plus timestamps; the server reads new tokens from `outputs`.

    `num_tokens` counts prompt and generated tokens; like vLLM v1 the scheduler only tracks
    how many of them have been computed, so prefill, chunked prefill, decode and recompute
    after preemption are all "compute num_tokens - num_computed_tokens more tokens".
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    lora: str | None = None
    # The body's `priority`: under --scheduling-policy priority, lower is served first.
    priority: int = 0
    # The adapter's path as given to --lora-modules: vLLM hashes it into the blocks.
    lora_path: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache at first admission (usage.cached_tokens).
    num_cached_tokens: int | None = None
    # On a replica with a KV connector: prompt tokens another replica computed, loaded at
    # first admission instead of prefilled (0: none); None without a connector.
    external_tokens: int | None = None
    queued_time: float | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    # Lists of new token ids per step; None marks the end (finished or aborted).
    outputs: asyncio.Queue[list[int] | None] = field(default_factory=asyncio.Queue)
    _block_hashes: list[int] = field(default_factory=list)
    _last_digest: bytes | None = None  # full digest of the last hashed block: the chain's parent
    # prompt + output in one list, kept in step (not rebuilt per step: prompts can be long).
    _all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._all_token_ids.append(token)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output tokens (the live list: do not modify)."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of all full blocks so far, extended incrementally as tokens arrive.

        vLLM's hashes (see kv_cache.py): the LoRA adapter is part of the hash (its extra keys),
        as an adapter's KV differs from the base model's for the same tokens.
        """
        done = len(self._block_hashes)
        tokens = self.all_token_ids
        if (done + 1) * block_size <= len(tokens):
            digests = hash_block_digests(
                tokens[done * block_size :],
                block_size,
                lora_extra_keys(self.lora, self.lora_path),
                self._last_digest,
            )
            self._last_digest = digests[-1]
            self._block_hashes += [external_hash(d) for d in digests]
        return self._block_hashes
