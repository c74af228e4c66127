"""HTTP surface of one replica: vLLM's OpenAI server endpoints plus admin faults.

Every response carries `x-served-by: host:port` so tests and benchmarks can see which replica
served a request without trusting the router under test, and `GET /admin/headers` counts the
header names inference requests arrived with, so a test can see what the gateway let through
(e.g. that a client's `x-priority` never reached a replica).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from epp.sim.protocol import (
    APIError,
    ResponseShape,
    chat_messages,
    completion_prompt,
    new_id,
    parse_generation,
    usage,
)
from epp.sim.replica import Replica
from epp.sim.request import SimRequest, Status
from epp.wire import DATA_PARALLEL_HOST_PORT, DATA_PARALLEL_RANK

REPLICA = web.AppKey("replica", Replica)
# Header names counted for GET /admin/headers: inference routes only, at most this many names
# (a client choosing new names cannot grow the replica without bound).
_COUNTED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
MAX_HEADER_NAMES = 256
SEEN_HEADERS = web.AppKey("seen_headers", Counter[str])
# The data-parallel rank that served a request, sent back as ``x-served-rank``.
SERVED_RANK = web.RequestKey("served_rank", int)
DEFAULT_MAX_TOKENS = 16
# Prompts at least this long get their block hashes computed off the event loop.
OFFLOAD_HASH_TOKENS = 8192
SIM_VERSION = "0.32.0+epp.sim"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _replica(request: web.Request) -> Replica:
    return request.app[REPLICA]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(
        data, status=status, dumps=lambda d: json.dumps(d, separators=(",", ":"))
    )


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


@web.middleware
async def count_headers(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path in _COUNTED_PATHS:
        seen = request.app[SEEN_HEADERS]
        for name in {k.lower() for k in request.headers}:
            if name in seen or len(seen) < MAX_HEADER_NAMES:
                seen[name] += 1
    response: web.StreamResponse = await handler(request)
    return response


async def get_headers(request: web.Request) -> web.Response:
    """How many inference requests carried each header name (lower case)."""
    return _json(dict(sorted(request.app[SEEN_HEADERS].items())))


@web.middleware
async def api_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except APIError as e:
        return _json(e.body(), e.status)


def _rank(replica: Replica, headers: Mapping[str, str]) -> int | None:
    """The data-parallel rank a request names: vLLM's ``x-data-parallel-rank``, or llm-d's
    ``x-data-parallel-host-port`` (the replica's port plus the rank); None: the server picks."""
    size = len(replica.engines)
    named = headers.get(DATA_PARALLEL_RANK)
    if named is None and (host_port := headers.get(DATA_PARALLEL_HOST_PORT)) is not None:
        port = host_port.rpartition(":")[2]
        named = str(int(port) - replica.config.port) if port.isdigit() else host_port
    if named is None:
        return None
    if not named.isdigit() or int(named) >= size:
        raise APIError(400, f"data parallel rank {named!r} is not in 0..{size - 1}")
    return int(named)


def _resolve_model(replica: Replica, model: str) -> str | None:
    """The LoRA adapter a model name selects (None = base model); 404 when unknown."""
    if model == replica.config.model:
        return None
    if model in replica.config.lora_modules:
        return model
    raise APIError(404, f"The model `{model}` does not exist.", "model")


def _check_length(replica: Replica, num_prompt: int, max_tokens: int) -> None:
    limit = replica.config.engine.max_model_len
    if num_prompt + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion.",
        )


async def _apply_faults(replica: Replica) -> None:
    if replica.faults.latency_ms:
        await asyncio.sleep(replica.faults.latency_ms / 1000)
    if replica.faults.should_fail():
        raise APIError(500, "simulated failure (admin fault error_rate)")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    replica = _replica(request)
    body = await _body(request)
    params = parse_generation(body, replica.config.model, DEFAULT_MAX_TOKENS)
    lora = _resolve_model(replica, params.model)
    tok = replica.tokenizer
    if chat:
        try:
            tokens = await tok.encode_chat_async(
                chat_messages(body), bool(body.get("add_generation_prompt", True))
            )
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
    else:
        prompt = completion_prompt(body)
        if isinstance(prompt, list):
            vocab = tok.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"Token id out of vocabulary (size {vocab}).", "prompt")
            tokens = prompt
        else:
            tokens = await tok.encode_async(prompt, bool(body.get("add_special_tokens", True)))
    _check_length(replica, len(tokens), params.max_tokens)
    await _apply_faults(replica)

    shape = ResponseShape.new(chat, params.model)
    rank = _rank(replica, request.headers)
    engine = replica.engine_for(rank)
    request[SERVED_RANK] = replica.engines.index(engine)
    arrival = engine.clock()
    overhead = engine.config.profile.request_overhead_s * engine.config.time_scale
    if overhead:
        await asyncio.sleep(overhead)
    req = SimRequest(
        shape.request_id,
        tokens,
        params.max_tokens,
        arrival,
        lora,
        priority=params.priority,
        lora_path=replica.config.lora_modules[lora] if lora else None,
    )
    if engine.config.enable_prefix_caching and len(tokens) >= OFFLOAD_HASH_TOKENS:
        # vLLM's sha256 block hashes cost a few us per block: hash a long prompt in a worker
        # thread (the engine then finds them cached) rather than stall every replica's loop.
        await asyncio.to_thread(req.block_hashes, engine.config.block_size)
    transfer = replica.kv_transfer
    transfer_params = body.get("kv_transfer_params")
    if transfer is not None:
        req.external_tokens = transfer.loadable(req, transfer_params)
        if req.external_tokens:
            await asyncio.sleep(transfer.seconds(req.external_tokens) * engine.config.time_scale)
    engine.submit(req)
    try:
        if params.stream:
            return await _stream(
                request, replica, req, shape, params.include_usage, params.continuous_usage
            )
        ids: list[int] = []
        while (new := await req.outputs.get()) is not None:
            ids += new
        if req.status is not Status.FINISHED:
            raise APIError(500, "request aborted")
        use = _usage(replica, req)
        answer = shape.full(tok.decode(ids), "length", use)
        if transfer is not None:
            answer["kv_transfer_params"] = transfer.handed_over(req, transfer_params)
        return _json(answer)
    finally:
        engine.abort(req)


def _usage(replica: Replica, req: SimRequest) -> dict[str, Any]:
    details = replica.config.enable_prompt_tokens_details
    cached = (req.num_cached_tokens or 0) if details else None
    return usage(req.num_prompt_tokens, len(req.output_token_ids), cached)


async def next_tokens(req: SimRequest) -> tuple[list[int], bool]:
    """Wait for new tokens, then take every token already queued; True once the request ended.

    Like vLLM's output collector, tokens that piled up while the writer was busy are merged
    into one chunk instead of falling further behind.
    """
    ids: list[int] = []
    new = await req.outputs.get()
    while new is not None:
        ids += new
        if req.outputs.empty():
            return ids, False
        new = req.outputs.get_nowait()
    return ids, True


async def _stream(
    request: web.Request,
    replica: Replica,
    req: SimRequest,
    shape: ResponseShape,
    include_usage: bool,
    continuous_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)

    async def send(chunk: dict[str, Any]) -> None:
        if continuous_usage and include_usage:
            chunk["usage"] = _usage(replica, req)
        await resp.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

    if shape.chat:
        await send(shape.chunk("", None, role=True))
    received = 0
    done = False
    while not done:
        ids, done = await next_tokens(req)
        if ids:
            received += len(ids)
            finish = "length" if received == req.max_tokens else None
            await send(shape.chunk(replica.tokenizer.decode(ids), finish))
    if include_usage and req.status is Status.FINISHED:
        await resp.write(
            b"data: "
            + json.dumps(shape.usage_chunk(_usage(replica, req)), separators=(",", ":")).encode()
            + b"\n\n"
        )
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: prompt (special tokens added by default) or chat messages (not)."""
    replica = _replica(request)
    body = await _body(request)
    if "model" in body and body["model"] is not None:
        _resolve_model(replica, body["model"])
    tok = replica.tokenizer
    if "messages" in body:
        try:
            text = tok.apply_chat_template(
                chat_messages(body), bool(body.get("add_generation_prompt", True))
            )
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        tokens = await tok.encode_async(text, bool(body.get("add_special_tokens", False)))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string", "prompt")
        tokens = await tok.encode_async(prompt, bool(body.get("add_special_tokens", True)))
    strs = [tok.tokenizer.id_to_token(t) for t in tokens] if body.get("return_token_strs") else None
    return _json(
        {
            "count": len(tokens),
            "max_model_len": replica.config.engine.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    replica = _replica(request)
    body = await _body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise APIError(400, "'tokens' must be a list of token ids", "tokens")
    # vLLM's /detokenize keeps special tokens ("<s><|im_start|>..."), unlike generated text.
    return _json({"prompt": replica.tokenizer.decode(tokens, skip_special_tokens=False)})


async def models(request: web.Request) -> web.Response:
    replica = _replica(request)
    created = int(time.time())
    root = str(replica.tokenizer.directory)
    cfg = replica.config

    def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            # vLLM reports no length for an adapter.
            "max_model_len": None if parent else cfg.engine.max_model_len,
            "permission": [
                {
                    "id": new_id("modelperm"),
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    data = [card(cfg.model, root, None)]
    data += [card(name, path, cfg.model) for name, path in cfg.lora_modules.items()]
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return _json({"version": SIM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    replica = _replica(request)
    return web.Response(
        body=replica.render_metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def _server_info(replica: Replica) -> dict[str, Any]:
    """sglang's /get_server_info fields that sglang-router reads (model_path, sizes, dp_size).

    model_path points at the tokenizer directory: the router loads its tokenizer from there.
    """
    cfg = replica.config
    path = str(replica.tokenizer.directory)
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": cfg.model,
        "is_generation": True,
        "dp_size": cfg.data_parallel_size,
        "version": SIM_VERSION,
        "max_total_num_tokens": cfg.engine.num_gpu_blocks * cfg.engine.block_size,
        "max_running_requests": cfg.engine.max_num_seqs,
        "max_prefill_tokens": cfg.engine.max_num_batched_tokens,
        "page_size": cfg.engine.block_size,
        "context_length": cfg.engine.max_model_len,
    }


async def server_info(request: web.Request) -> web.Response:
    return _json(_server_info(_replica(request)))


async def model_info(request: web.Request) -> web.Response:
    info = _server_info(_replica(request))
    keys = ("model_path", "tokenizer_path", "served_model_name", "is_generation")
    return _json({k: info[k] for k in keys})


async def get_faults(request: web.Request) -> web.Response:
    return _json(_replica(request).faults.as_dict())


async def post_faults(request: web.Request) -> web.Response:
    replica = _replica(request)
    body = await _body(request)
    replica.faults.update(body)
    for engine in replica.engines:
        if replica.faults.hang:
            engine.pause()
        else:
            engine.resume()
        if body.get("clear_cache"):
            engine.kv.pool.reset(force=True)
    if body.get("crash"):
        # Answer first so the caller is not left guessing, then die.
        asyncio.get_running_loop().call_later(0.05, replica.crash)
    return _json(replica.faults.as_dict())


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's dev-mode route: `{"success": false}` while blocks are in use, unless
    `?reset_running_requests=true`, which preempts the running requests first."""
    preempt = request.query.get("reset_running_requests", "").lower() == "true"
    success = True
    for engine in _replica(request).engines:
        if preempt:
            engine.scheduler.preempt_all()
        success = engine.kv.pool.reset() and success
    return _json({"success": success})


def make_app(replica: Replica) -> web.Application:
    app = web.Application(middlewares=[count_headers, api_errors], client_max_size=64 * 1024 * 1024)
    app[REPLICA] = replica
    app[SEEN_HEADERS] = Counter()
    served_by = replica.config.address

    async def add_served_by(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-served-by"] = served_by
        if SERVED_RANK in request:
            response.headers["x-served-rank"] = str(request[SERVED_RANK])

    app.on_response_prepare.append(add_served_by)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/admin/faults", get_faults)
    app.router.add_get("/admin/headers", get_headers)
    app.router.add_post("/admin/faults", post_faults)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app
