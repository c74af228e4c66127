"""Prefill/decode disaggregation in the simulator: a replica's KV connector (docs/pd.md).

A replica with a connector behaves like vLLM with ``kv_role: kv_both``: it hands over the KV of
the prompts it prefills, and takes over KV another replica computed instead of prefilling it.

- ``nixl``: a request with ``kv_transfer_params.do_remote_decode`` is answered with the
  parameters a decode replica needs to pull its KV (``remote_engine_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port``, ...); a request carrying them with ``do_remote_prefill``
  gets its prompt's whole blocks from that replica.
- ``shared-storage`` (vLLM's ExampleConnector): every prefilled prompt leaves an entry in a
  directory the replicas share, keyed by its whole blocks' hash; a request whose prompt has an
  entry loads those tokens.

Loaded tokens are not computed: the request waits ``tokens / bandwidth`` seconds (the transfer,
scaled by the time scale), then its prefill skips them, and they count as external prefix-cache
hits (``vllm:external_prefix_cache_hits``), as vLLM counts a connector's hits.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from epp.sim.request import SimRequest

log = logging.getLogger(__name__)

Connector = Literal["nixl", "shared-storage"]
# Tokens per second between replicas: ~25 GB/s of RDMA at 128 KiB of KV per token (an 8B model).
DEFAULT_BANDWIDTH = 200_000.0


@dataclass(frozen=True)
class KVTransferConfig:
    connector: Connector
    shared_dir: str | None = None
    bandwidth: float = DEFAULT_BANDWIDTH


class KVTransfer:
    def __init__(self, config: KVTransferConfig, host: str, port: int, block_size: int) -> None:
        self.config = config
        self.host, self.port = host, port
        self.block_size = block_size
        self.engine_id = f"sim-{host}-{port}"
        self._dir = Path(config.shared_dir) if config.shared_dir else None
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)

    def loadable(self, req: SimRequest, params: Any) -> int:
        """Prompt tokens ``req`` can load instead of computing (whole blocks, never the last
        prompt token, whose logits must be computed)."""
        bs = self.block_size
        limit = (req.num_prompt_tokens - 1) // bs * bs
        if self.config.connector == "nixl":
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                return 0
            blocks = params.get("remote_block_ids")
            if not isinstance(blocks, list):
                return 0
            offered = params.get("remote_num_tokens")
            tokens = offered if isinstance(offered, int) else len(blocks) * bs
            return min(tokens // bs * bs, len(blocks) * bs, limit)
        entry = self._entry(req)
        if entry is None or not entry.exists():
            return 0
        try:
            stored = int(entry.read_text())
        except (OSError, ValueError):
            return 0
        return min(stored, limit)

    def seconds(self, tokens: int) -> float:
        return tokens / self.config.bandwidth

    def handed_over(self, req: SimRequest, params: Any) -> dict[str, Any] | None:
        """After ``req`` was prefilled: what the answer carries (NIXL), or None; with shared
        storage the prompt's entry is written."""
        if self.config.connector == "shared-storage":
            entry = self._entry(req)
            if entry is not None:
                tokens = req.num_prompt_tokens // self.block_size * self.block_size
                # Written whole then renamed: a reader never sees half an entry.
                partial = entry.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(str(tokens))
                partial.replace(entry)
            return None
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return None
        blocks = req.num_prompt_tokens // self.block_size
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(range(blocks)),
            "remote_request_id": req.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": blocks * self.block_size,
            "tp_size": 1,
        }

    def _entry(self, req: SimRequest) -> Path | None:
        blocks = req.num_prompt_tokens // self.block_size
        if self._dir is None or not blocks:
            return None
        key = req.block_hashes(self.block_size)[blocks - 1]
        return self._dir / f"{key:016x}"
