"""The two legs of a disaggregated request, as request bodies (docs/pd.md).

The prefill leg computes the prompt's KV on the prefill replica and generates one token, not
streamed; the decode leg is the client's request to the local engine, which then finds the KV
(shared storage) or pulls it (NIXL, with the prefill answer's ``kv_transfer_params``). The
field names are vLLM's KV-connector protocol, as llm-d's sidecar speaks it.
"""

from __future__ import annotations

from typing import Any, Literal

Connector = Literal["nixl", "shared-storage"]
CONNECTORS: tuple[Connector, ...] = ("nixl", "shared-storage")

# What a NIXL prefill leg asks for: keep the KV for a remote decode, which will pull it.
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What a decode leg needs from the prefill answer to pull the KV (NIXL).
REQUIRED_PARAMS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
TRANSFER = "kv_transfer_params"


def prefill_body(data: dict[str, Any], connector: Connector) -> dict[str, Any]:
    """The prefill leg's body for the client's ``data``: one token, not streamed."""
    body = {k: v for k, v in data.items() if k not in ("stream_options", TRANSFER)}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if connector == "nixl":
        body[TRANSFER] = dict(_REMOTE_DECODE)
    return body


def decode_body(
    data: dict[str, Any], connector: Connector, prefilled: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The decode leg's body: the client's request, with (NIXL) the prefill answer's transfer
    parameters. None when the answer cannot be used (NIXL without the parameters to pull the
    KV): the engine then prefills itself."""
    body = {k: v for k, v in data.items() if k != TRANSFER}
    if connector == "shared-storage":
        return body
    params = (prefilled or {}).get(TRANSFER)
    if not isinstance(params, dict) or any(params.get(k) is None for k in REQUIRED_PARAMS):
        return None
    body[TRANSFER] = params
    return body
