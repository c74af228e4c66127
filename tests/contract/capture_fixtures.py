"""Capture fixtures and measurements from a real vLLM (CPU) server.

    bash tests/contract/setup_vllm.sh
    .venv/bin/python tests/contract/capture_fixtures.py [--out tests/fixtures/vllm]

Starts two servers one after the other (never side by side, the box is shared):
  1. base server, VLLM_SERVER_DEV_MODE=1 (for /reset_prefix_cache -> AllBlocksCleared):
     endpoints, /tokenize, a completion, a streamed chat, prefix-cache counter semantics,
     kv_cache_usage_perc semantics, latencies, eviction (BlockRemoved), reset.
  2. LoRA server (--enable-lora, adapter `tiny-lora`): /v1/models, vllm:lora_requests_info
     while a LoRA request runs and after, KV events of a LoRA request, block-hash determinism
     across a restart, ZMQ seq restart.

Everything goes to --out; `measurements.json` holds the numbers (README.md explains them).
Prompts used for counter/latency measurements are token-id lists (the completions API accepts
them), so token counts are exact and no BOS is added.  Runs in the project .venv (needs msgpack
and pyzmq, both project dependencies) or in the vLLM venv.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import pickle
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_tiny_model import DEFAULT_LORA_DIR, TOKENIZER_DIR, tokenizer_digest  # noqa: E402
from vllm_server import (  # noqa: E402
    KV_CACHE_BYTES,
    LORA_NAME,
    REPO,
    SERVED_MODEL,
    build_command,
    start_vllm,
)

VOCAB_LO, VOCAB_HI = 5, 4095  # skip the 5 special tokens so token-id prompts are plain text


# --------------------------------------------------------------------------- HTTP helpers
class Http:
    def __init__(self, base_url: str) -> None:
        self.base = base_url

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = 120.0
    ) -> tuple[int, dict[str, str], bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers.items()), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers.items()), e.read()

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, body = self.request("GET", path)
        return status, body

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, _, raw = self.request("POST", path, body)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def metrics(self) -> str:
        return self.get("/metrics")[1].decode()

    def stream(self, path: str, body: Any) -> tuple[bytes, float, float]:
        """POST and read an SSE body; returns (raw bytes, ttft s, total s)."""
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        t0 = time.perf_counter()
        ttft = -1.0
        chunks: list[bytes] = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if ttft < 0 and line.startswith(b"data:"):
                    ttft = time.perf_counter() - t0
                chunks.append(line)
        return b"".join(chunks), ttft, time.perf_counter() - t0


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line (labels kept verbatim)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric(text: str, name: str) -> float:
    """Sum of all series of `name` (exact metric name, any labels)."""
    total = 0.0
    for key, value in parse_metrics(text).items():
        if key == name or key.startswith(name + "{"):
            total += value
    return total


def lines_of(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name)]


# --------------------------------------------------------------------------- KV events
class KvRecorder:
    """ZMQ SUB in a thread: keeps every multipart message with the phase it arrived in."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")  # all topics: record what the engine sends
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.connect(endpoint)
        self.topic = topic
        self.phase = "startup"
        self.messages: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(1.0)  # ZMQ slow joiner: let the subscription reach the publisher

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            with self._lock:
                self.messages.append(
                    {"phase": self.phase, "recv_time": time.time(), "frames": frames}
                )

    def set_phase(self, phase: str) -> None:
        self.drain()
        self.phase = phase

    def drain(self, quiet_s: float = 0.5) -> None:
        """Wait until no message arrived for quiet_s (events trail the HTTP response)."""
        last = -1
        while True:
            time.sleep(quiet_s)
            with self._lock:
                n = len(self.messages)
            if n == last:
                return
            last = n

    def of_phase(self, phase: str) -> list[dict[str, Any]]:
        with self._lock:
            return [m for m in self.messages if m["phase"] == phase]

    def close(self) -> None:
        self.drain()
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)


def decode_payload(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return {"__bytes_hex__": obj.hex()}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def events_of(msg: dict[str, Any]) -> list[dict[str, Any]]:
    batch = decode_payload(msg["frames"][2])
    return list(batch[1])


def write_frames(path: Path, messages: Iterable[dict[str, Any]]) -> int:
    n = 0
    with path.open("w") as fh:
        for m in messages:
            topic, seq, payload = m["frames"]
            line = {
                "phase": m["phase"],
                "recv_time": round(m["recv_time"], 3),
                "frames_b64": [base64.b64encode(f).decode() for f in m["frames"]],
                # Convenience only; tests should decode frames_b64 themselves.
                "topic": topic.decode(errors="replace"),
                "seq": int.from_bytes(seq, "big"),
                "decoded": jsonable(decode_payload(payload)),
            }
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")
            n += 1
    return n


# --------------------------------------------------------------------------- vLLM hashing
def vllm_block_hashes(
    tokens: list[int], block_size: int, extra_keys: tuple[Any, ...] | None = None
) -> list[int]:
    """Recompute vLLM's external block hashes (prefix_caching_hash_algo=sha256).

    vLLM 0.32: NONE_HASH = sha256(pickle("vllm-none-hash")) (fixed seed for sha256, unless
    PYTHONHASHSEED is set); block = sha256(pickle((parent_bytes, tuple(tokens), extra_keys)))
    with pickle protocol 5; KV events publish the low 64 bits (big-endian int) of the 32-byte
    digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default).  extra_keys is None for a
    plain request; for a LoRA request it is (("lora", lora_name, lora_path),) on every block,
    so LoRA hashes depend on the adapter's path on the server's disk.
    """

    def h(obj: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent = h("vllm-none-hash")
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = h((parent, blk, extra_keys))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


# --------------------------------------------------------------------------- phases
def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def complete_ids(
    http: Http,
    ids: list[int],
    max_tokens: int = 16,
    model: str = SERVED_MODEL,
) -> tuple[float, dict[str, Any]]:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    status, resp = http.post("/v1/completions", body)
    dt = time.perf_counter() - t0
    assert status == 200, (status, resp)
    return dt, resp


def counters(http: Http) -> tuple[float, float]:
    text = http.metrics()
    return (
        metric(text, "vllm:prefix_cache_queries_total"),
        metric(text, "vllm:prefix_cache_hits_total"),
    )


def counted(
    http: Http,
    rec: KvRecorder,
    label: str,
    ids: list[int],
    max_tokens: int = 16,
) -> dict[str, Any]:
    """One request; report counter deltas and the KV events it caused."""
    rec.set_phase(label)
    q0, h0 = counters(http)
    dt, resp = complete_ids(http, ids, max_tokens)
    time.sleep(1.2)  # metrics are pushed from the engine about once per second
    q1, h1 = counters(http)
    rec.drain()
    stored: list[int] = []
    removed = 0
    for m in rec.of_phase(label):
        for ev in events_of(m):
            if ev.get("type") == "BlockStored":
                stored.append(len(ev["block_hashes"]))
            elif ev.get("type") == "BlockRemoved":
                removed += len(ev["block_hashes"])
    return {
        "prompt_tokens": len(ids),
        "max_tokens": max_tokens,
        "usage": resp.get("usage"),
        "latency_s": round(dt, 4),
        "queries_delta": q1 - q0,
        "hits_delta": h1 - h0,
        "block_stored_events_blocks": stored,
        "blocks_removed": removed,
    }


def poll_during(
    http: Http, fn: Any, names: list[str], period: float = 0.1
) -> tuple[Any, list[dict[str, Any]]]:
    """Run fn() in a thread while sampling /metrics; returns (fn result, samples)."""
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(r=fn()))
    t.start()
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    while t.is_alive():
        text = http.metrics()
        sample: dict[str, Any] = {"t": round(time.perf_counter() - t0, 2)}
        for n in names:
            sample[n] = lines_of(text, n) if n.endswith("_info") else metric(text, n)
        samples.append(sample)
        time.sleep(period)
    t.join()
    return result.get("r"), samples


def capture_base(out: Path, meas: dict[str, Any]) -> list[int]:
    rng = random.Random(1234)
    t0 = time.monotonic()
    with start_vllm(dev_mode=True) as srv:
        meas["base_server"] = {
            "time_to_healthy_s": round(time.monotonic() - t0, 1),
            "command": build_command(
                model_dir=Path(".cache/tiny-model"),
                port=srv.port,
                kv_port=srv.kv_port,
                lora_dir=None,
            ),
        }
        http = Http(srv.base_url)
        rec = KvRecorder(srv.kv_events_endpoint, srv.kv_topic)
        meas["base_server"]["rss_idle_bytes"] = srv.rss_bytes()

        # ---- endpoints (server_info-style probes; 404s are facts too)
        rec.set_phase("endpoints")
        meas["_probes_dev_mode"] = probe_endpoints(http)
        (out / "models.json").write_text(
            json.dumps(json.loads(http.get("/v1/models")[1]), indent=2) + "\n"
        )

        # ---- tokenize / render
        rec.set_phase("tokenize")
        chat_msgs = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        calls: list[tuple[str, dict[str, Any]]] = [
            (
                "/tokenize",
                {"model": SERVED_MODEL, "prompt": "The quick brown fox jumps over the lazy dog."},
            ),
            (
                "/tokenize",
                {
                    "model": SERVED_MODEL,
                    "add_special_tokens": False,
                    "prompt": "The quick brown fox jumps over the lazy dog.",
                },
            ),
            (
                "/tokenize",
                {"model": SERVED_MODEL, "messages": chat_msgs, "add_generation_prompt": True},
            ),
            (
                "/tokenize",
                {
                    "model": SERVED_MODEL,
                    "messages": chat_msgs,
                    "add_generation_prompt": True,
                    "return_token_strs": True,
                },
            ),
            ("/detokenize", {"model": SERVED_MODEL, "tokens": [0, 3, 1000, 2000, 4]}),
            (
                "/v1/completions/render",
                {"model": SERVED_MODEL, "prompt": "The quick brown fox jumps over the lazy dog."},
            ),
            ("/v1/chat/completions/render", {"model": SERVED_MODEL, "messages": chat_msgs}),
            ("/tokenize", {"model": "no-such-model", "prompt": "x"}),
        ]
        tok_records = []
        for path, body in calls:
            status, resp = http.post(path, body)
            tok_records.append(
                {
                    "request": {"method": "POST", "path": path, "body": body},
                    "status": status,
                    "response": resp,
                }
            )
        (out / "tokenize.json").write_text(
            json.dumps(
                {
                    "vllm_version": "0.32.0",
                    "tokenizer_sha256": tokenizer_digest(TOKENIZER_DIR),
                    "calls": tok_records,
                },
                indent=2,
            )
            + "\n"
        )

        # ---- completion + streamed chat
        rec.set_phase("completion")
        comp_req = {
            "model": SERVED_MODEL,
            "prompt": "The quick brown fox jumps over the",
            "max_tokens": 8,
            "temperature": 0,
        }
        status, hdrs, raw = http.request("POST", "/v1/completions", comp_req)
        (out / "completion.json").write_text(
            json.dumps(
                {
                    "request": {"method": "POST", "path": "/v1/completions", "body": comp_req},
                    "status": status,
                    "content_type": hdrs.get("content-type"),
                    "response": json.loads(raw),
                },
                indent=2,
            )
            + "\n"
        )
        rec.set_phase("chat_stream")
        chat_req = {
            "model": SERVED_MODEL,
            "messages": chat_msgs,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sse, _, _ = http.stream("/v1/chat/completions", chat_req)
        (out / "chat_stream.txt").write_bytes(sse)
        (out / "chat_stream.request.json").write_text(
            json.dumps(
                {"method": "POST", "path": "/v1/chat/completions", "body": chat_req}, indent=2
            )
            + "\n"
        )

        # ---- prefix-cache counter semantics (token-id prompts, exact counts)
        p500 = rand_tokens(rng, 500)
        p512 = rand_tokens(rng, 512)
        partial = p500[:300] + rand_tokens(rng, 200)
        short = rand_tokens(rng, 20)
        sem: dict[str, Any] = {}
        sem["cold_500"] = counted(http, rec, "cold_500", p500)
        sem["hit_500"] = counted(http, rec, "hit_500", p500)
        sem["cold_512_exact_16_blocks"] = counted(http, rec, "cold_512", p512)
        sem["hit_512_exact_16_blocks"] = counted(http, rec, "hit_512", p512)
        sem["partial_300_shared_of_500"] = counted(http, rec, "partial_500", partial)
        sem["short_20_cold"] = counted(http, rec, "short_20", short, max_tokens=16)
        sem["short_20_repeat"] = counted(http, rec, "short_20_repeat", short, max_tokens=16)
        sem["decode_fills_blocks_20_plus_100"] = counted(
            http, rec, "decode_fill", rand_tokens(rng, 20), max_tokens=100
        )
        meas["prefix_cache_semantics"] = sem

        def stored_hashes(phase: str) -> list[int]:
            return [
                h
                for m in rec.of_phase(phase)
                for ev in events_of(m)
                if ev.get("type") == "BlockStored"
                for h in ev["block_hashes"]
            ]

        cold, hit = stored_hashes("cold_500"), stored_hashes("hit_500")
        meas["duplicate_block_stored_on_hit"] = {
            "cold_500_stored": len(cold),
            "hit_500_stored": len(hit),
            "hit_restores_hashes_already_stored": bool(hit) and set(hit) <= set(cold),
        }

        # hashes: recompute offline and compare with BlockStored of cold_500
        ev_hashes: list[int] = []
        parent_of_first: Any = "unset"
        for m in rec.of_phase("cold_500"):
            for ev in events_of(m):
                if ev.get("type") == "BlockStored":
                    if parent_of_first == "unset":
                        parent_of_first = ev.get("parent_block_hash")
                    ev_hashes.extend(ev["block_hashes"])
        offline = vllm_block_hashes(p500, srv.block_size)
        meas["block_hash_offline_recompute"] = {
            "prompt_blocks": len(offline),
            "event_blocks": len(ev_hashes),
            "prompt_blocks_match": ev_hashes[: len(offline)] == offline,
            "first_block_parent_block_hash": parent_of_first,
        }

        # ---- kv_cache_usage_perc semantics
        rec.set_phase("usage")
        idle = http.metrics()
        num_blocks = int(srv.cache_config()["num_gpu_blocks"])
        usable = num_blocks - 1  # vLLM reserves one null block; usage = used / (blocks - 1)
        usage: dict[str, Any] = {
            "idle_after_requests": metric(idle, "vllm:kv_cache_usage_perc"),
            "num_gpu_blocks": num_blocks,
        }
        long_prompt = rand_tokens(rng, 500)
        _, samples = poll_during(
            http,
            lambda: complete_ids(http, long_prompt, max_tokens=300),
            ["vllm:kv_cache_usage_perc", "vllm:num_requests_running"],
        )
        usage["running_500_plus_300"] = {
            "usable_blocks": usable,
            "first_usage_while_running": next(
                (
                    s["vllm:kv_cache_usage_perc"]
                    for s in samples
                    if s["vllm:num_requests_running"] >= 1
                ),
                None,
            ),
            "blocks_for_500_prompt": 16,
            "max_usage": max(s["vllm:kv_cache_usage_perc"] for s in samples),
            "blocks_at_end_800_tokens": 25,
            "samples": samples[:: max(1, len(samples) // 12)],
        }
        time.sleep(1.2)
        usage["idle_after_long"] = metric(http.metrics(), "vllm:kv_cache_usage_perc")
        # two concurrent requests sharing a 480-token prefix: shared blocks count once
        shared = rand_tokens(rng, 480)
        complete_ids(http, shared + rand_tokens(rng, 20), max_tokens=1)  # warm the prefix

        def two() -> None:
            ts = [
                threading.Thread(
                    target=complete_ids, args=(http, shared + rand_tokens(rng, 20), 300)
                )
                for _ in range(2)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        _, samples2 = poll_during(
            http, two, ["vllm:kv_cache_usage_perc", "vllm:num_requests_running"], period=0.05
        )
        both = [
            s["vllm:kv_cache_usage_perc"] for s in samples2 if s["vllm:num_requests_running"] == 2
        ]
        usage["two_running_sharing_480_prefix"] = {
            "usable_blocks": usable,
            "min_usage_while_2_running": min(both, default=None),
            "min_blocks_while_2_running": round(min(both) * usable) if both else None,
            "blocks_if_shared_at_prefill": 15 + 2 * 1,
            "blocks_if_not_shared_at_prefill": 2 * 16,
            "max_usage": max(s["vllm:kv_cache_usage_perc"] for s in samples2),
        }
        meas["kv_cache_usage"] = usage

        # ---- the committed metrics page: after a handful of requests incl. prefix hits
        time.sleep(1.2)
        (out / "metrics.txt").write_text(http.metrics())
        meas["base_server"]["rss_after_requests_bytes"] = srv.rss_bytes()

        # ---- latency, 500-token prompts, cold vs full prefix hit (median of 5)
        rec.set_phase("latency")
        lat: dict[str, list[float]] = {
            k: []
            for k in (
                "cold_max16",
                "hit_max16",
                "cold_max1",
                "hit_max1",
                "cold_ttft_stream",
                "hit_ttft_stream",
                "decode_per_token_100_prompt",
            )
        }
        for _ in range(8):
            p = rand_tokens(rng, 500)
            lat["cold_max16"].append(complete_ids(http, p, 16)[0])
            lat["hit_max16"].append(complete_ids(http, p, 16)[0])
            q = rand_tokens(rng, 500)
            lat["cold_max1"].append(complete_ids(http, q, 1)[0])
            lat["hit_max1"].append(complete_ids(http, q, 1)[0])
            s = rand_tokens(rng, 500)
            body = {
                "model": SERVED_MODEL,
                "prompt": s,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            lat["cold_ttft_stream"].append(http.stream("/v1/completions", body)[1])
            lat["hit_ttft_stream"].append(http.stream("/v1/completions", body)[1])
            body = {
                "model": SERVED_MODEL,
                "prompt": rand_tokens(rng, 100),
                "max_tokens": 101,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            _, ttft, total = http.stream("/v1/completions", body)
            lat["decode_per_token_100_prompt"].append((total - ttft) / 100)
        meas["latency_500_tokens_s"] = {
            k: {
                "median": round(statistics.median(v), 4),
                "min": round(min(v), 4),
                "max": round(max(v), 4),
            }
            for k, v in lat.items()
        }

        # ---- eviction: 3 x 2000-token prompts = 186 full blocks > usable -> BlockRemoved
        rec.set_phase("eviction")
        for _ in range(3):
            complete_ids(http, rand_tokens(rng, 2000), max_tokens=1)
        rec.drain()
        meas["eviction"] = summarize_phase(rec, "eviction")

        # ---- reset: AllBlocksCleared
        rec.set_phase("reset")
        status, resp = http.post("/reset_prefix_cache", {})
        rec.drain(1.0)
        meas["reset_prefix_cache"] = {
            "status": status,
            "response": resp,
            **summarize_phase(rec, "reset"),
        }
        rec.set_phase("after_reset")
        meas["after_reset_same_prompt"] = counted(http, rec, "after_reset", p500)
        meas["after_reset_same_prompt"]["first_message_event_types"] = (
            [e.get("type") for e in events_of(rec.of_phase("after_reset")[0])]
            if rec.of_phase("after_reset")
            else []
        )
        rec.close()

        # KV-event fixture: everything except the bulky latency/eviction BlockStored frames
        # (keeps the file small: one eviction frame is enough to pin the BlockRemoved layout).
        keep: list[dict[str, Any]] = []
        evictions_kept = 0
        for m in rec.messages:
            if m["phase"] in ("latency", "usage"):
                continue
            if m["phase"] == "eviction":
                if evictions_kept or not any(e.get("type") == "BlockRemoved" for e in events_of(m)):
                    continue
                evictions_kept += 1
            keep.append(m)
        n = write_frames(out / "kv_events.msgpack.jsonl", keep)
        meas["kv_events_fixture"] = {"messages_total": len(rec.messages), "messages_kept": n}
        meas["kv_event_layout"] = describe_layout(rec.messages)
    return p500


PROBE_PATHS = (
    "/health",
    "/ping",
    "/version",
    "/load",
    "/kv_event_sources",
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
    "/is_sleeping",
    "/v1/models",
    "/metrics",
)


def probe_endpoints(http: Http) -> dict[str, Any]:
    """GET each path; keep status and a trimmed body (server_info is a ~20 KB env dump)."""
    info: dict[str, Any] = {}
    for path in PROBE_PATHS:
        status, body = http.get(path)
        try:
            parsed: Any = json.loads(body) if body else ""
        except ValueError:
            parsed = body.decode(errors="replace")
        if path == "/server_info" and isinstance(parsed, dict) and status == 200:
            parsed = {
                "__trimmed__": "top-level keys only, plus vllm_config",
                "keys": sorted(parsed),
                "vllm_config": parsed.get("vllm_config"),
            }
        elif path in ("/v1/models", "/metrics") and status == 200:
            parsed = "<see models.json / metrics.txt>"
        info[f"GET {path}"] = {"status": status, "body": parsed}
    return info


def summarize_phase(rec: KvRecorder, phase: str) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for m in rec.of_phase(phase):
        for ev in events_of(m):
            t = str(ev.get("type"))
            n = len(ev.get("block_hashes", [])) if isinstance(ev, dict) else 0
            counts[t + "_events"] = counts.get(t + "_events", 0) + 1
            counts[t + "_blocks"] = counts.get(t + "_blocks", 0) + n
    return {"messages": len(rec.of_phase(phase)), **counts}


def describe_layout(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Raw msgpack shape: outer array length, per event type the map key order as sent."""
    layout: dict[str, Any] = {}
    for m in messages:
        topic, seq, payload = m["frames"]
        batch = decode_payload(payload)
        layout.setdefault(
            "frames", [f"topic={topic!r}", f"seq={len(seq)} bytes big-endian", "payload=msgpack"]
        )
        layout.setdefault("batch_array_len", set()).add(len(batch))
        layout.setdefault("batch_third_element", set()).add(
            repr(batch[2]) if len(batch) > 2 else "absent"
        )
        # Decode preserving map order: msgpack returns dicts in wire order.
        for ev in batch[1]:
            kind = ev.get("type") if isinstance(ev, dict) else f"array:{ev[0]}"
            keys = list(ev.keys()) if isinstance(ev, dict) else f"array len {len(ev)}"
            layout.setdefault("events", {}).setdefault(kind, [])
            if keys not in layout["events"][kind]:
                layout["events"][kind].append(keys)
        layout.setdefault("seq_first_last", [None, None])
        s = int.from_bytes(seq, "big")
        if layout["seq_first_last"][0] is None:
            layout["seq_first_last"][0] = s
        layout["seq_first_last"][1] = s
    for k in ("batch_array_len", "batch_third_element"):
        if k in layout:
            layout[k] = sorted(layout[k])
    return layout


def capture_lora(out: Path, meas: dict[str, Any], p500: list[int]) -> None:
    rng = random.Random(99)
    t0 = time.monotonic()
    with start_vllm(lora=True) as srv:
        meas["lora_server"] = {"time_to_healthy_s": round(time.monotonic() - t0, 1)}
        http = Http(srv.base_url)
        rec = KvRecorder(srv.kv_events_endpoint, srv.kv_topic)
        meas["_probes_production"] = probe_endpoints(http)
        _, body = http.get("/v1/models")
        (out / "models_lora.json").write_text(json.dumps(json.loads(body), indent=2) + "\n")
        before = http.metrics()
        meas["lora_server"]["lora_info_before_any_request"] = lines_of(
            before, "vllm:lora_requests_info"
        )

        # hash determinism across restarts + seq restart
        rec.set_phase("base_after_restart")
        complete_ids(http, p500, 16)
        rec.set_phase("lora_request")
        lp = rand_tokens(rng, 100)
        _, samples = poll_during(
            http,
            lambda: complete_ids(http, lp, max_tokens=200, model=LORA_NAME),
            ["vllm:lora_requests_info", "vllm:num_requests_running"],
            period=0.2,
        )
        running = [s for s in samples if s["vllm:num_requests_running"] >= 1]
        meas["lora_server"]["lora_info_while_running"] = (
            running[len(running) // 2]["vllm:lora_requests_info"] if running else None
        )
        rec.set_phase("lora_repeat")
        complete_ids(http, lp, max_tokens=4, model=LORA_NAME)
        time.sleep(1.2)
        text = http.metrics()
        (out / "metrics_lora.txt").write_text(text)
        meas["lora_server"]["lora_info_after"] = lines_of(text, "vllm:lora_requests_info")
        meas["lora_server"]["rss_bytes"] = srv.rss_bytes()
        rec.close()

        base_hashes: list[int] = []
        for m in rec.of_phase("base_after_restart"):
            for ev in events_of(m):
                if ev.get("type") == "BlockStored":
                    base_hashes.extend(ev["block_hashes"])
        lora_hashes: list[int] = []
        for m in rec.of_phase("lora_request"):
            for ev in events_of(m):
                if ev.get("type") == "BlockStored":
                    lora_hashes.extend(ev["block_hashes"])
        offline = vllm_block_hashes(p500, srv.block_size)
        offline_lp = vllm_block_hashes(lp, srv.block_size)
        meas["lora_server"]["hashes_same_across_restart"] = base_hashes[: len(offline)] == offline
        meas["lora_server"]["lora_hashes_differ_from_base_hashing"] = (
            lora_hashes[: len(offline_lp)] != offline_lp
        )
        lora_key = (("lora", LORA_NAME, str(DEFAULT_LORA_DIR)),)
        offline_lora = vllm_block_hashes(lp, srv.block_size, lora_key)
        meas["lora_server"]["lora_hashes_offline_match_with_extra_key_lora_name_path"] = (
            lora_hashes[: len(offline_lora)] == offline_lora
        )
        meas["lora_server"]["seq_first"] = (
            int.from_bytes(rec.messages[0]["frames"][1], "big") if rec.messages else None
        )
        write_frames(out / "kv_events_lora.msgpack.jsonl", rec.messages)
        meas["kv_event_layout_lora"] = describe_layout(rec.messages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "vllm")
    ap.add_argument("--skip-lora", action="store_true")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    meas: dict[str, Any] = {
        "vllm_version": "0.32.0",
        "block_size": 32,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "tokenizer_sha256": tokenizer_digest(TOKENIZER_DIR),
        "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    p500 = capture_base(out, meas)
    if not args.skip_lora:
        capture_lora(out, meas, p500)
    (out / "server_info.json").write_text(
        json.dumps(
            {
                "vllm_version": "0.32.0",
                "note": "GET probes. production = normal server (the LoRA run); dev_mode = "
                "VLLM_SERVER_DEV_MODE=1 (adds /server_info, /reset_prefix_cache, ...)",
                "production": meas.pop("_probes_production", None),
                "dev_mode": meas.pop("_probes_dev_mode", None),
            },
            indent=2,
        )
        + "\n"
    )
    (out / "measurements.json").write_text(json.dumps(meas, indent=2, default=str) + "\n")
    print(json.dumps(meas, indent=2, default=str)[:20000])


if __name__ == "__main__":
    main()
