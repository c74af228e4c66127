"""`epp sim`: run one or more simulated vLLM replicas in this process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

from epp.data_parallel import MAX_RANKS
from epp.sim.engine import EngineConfig
from epp.sim.kv_transfer import DEFAULT_BANDWIDTH, KVTransferConfig
from epp.sim.profiles import PROFILES
from epp.sim.replica import Replica, ReplicaConfig
from epp.sim.request_queue import SchedulingPolicy
from epp.sim.tokenization import BUNDLED_DIR, SimTokenizer

DEFAULT_MAX_MODEL_LEN = 32768


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "sim",
        help="run simulated vLLM replicas",
        description="Simulated vLLM fleet: OpenAI API, vLLM /metrics, KV events, faults.",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="port of the first replica")
    p.add_argument("--replicas", type=int, default=1, help="independent replicas in this process")
    p.add_argument("--base-port", type=int, help="port of replica 0 (default: --port)")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--profile", choices=sorted(PROFILES), default="h100")
    p.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default="vllm",
        help="whose /metrics names and KV-event format to speak (docs/sglang.md)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies every modelled delay (0.1 = 10x faster)",
    )
    p.add_argument(
        "--speed",
        default="1",
        help="compute speed relative to the profile: one factor, or one per replica "
        "(2,2,1,1: two replicas twice as fast as the other two)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: profile's)")
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks (default: profile's)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument(
        "--kv-events-endpoint",
        help="ZMQ PUB bind address, e.g. tcp://*:5557 (replica i binds port + i, times "
        "--data-parallel-size)",
    )
    p.add_argument("--kv-events-topic", default="kv-events")
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines per replica, each its own rank (docs/data-parallel.md); rank r of a "
        "replica publishes KV events at its endpoint's port + r",
    )
    p.add_argument("--tokenizer", type=Path, default=BUNDLED_DIR, help="HF tokenizer directory")
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument(
        "--kv-connector",
        choices=["nixl", "shared-storage"],
        help="hand over and take over prompt KV between replicas (prefill/decode, docs/pd.md)",
    )
    p.add_argument("--kv-shared-dir", help="shared-storage connector: the directory replicas share")
    p.add_argument(
        "--kv-transfer-bandwidth",
        type=float,
        default=DEFAULT_BANDWIDTH,
        help="KV tokens per second moved between replicas",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=[p.value for p in SchedulingPolicy],
        default=SchedulingPolicy.FCFS.value,
        help="priority: serve and keep requests by the body's `priority` (lower first)",
    )


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules expects NAME=PATH, got {item!r}")
        out[name] = path
    return out


def parse_speeds(value: str, replicas: int) -> list[float]:
    try:
        speeds = [float(v) for v in value.split(",")]
    except ValueError:
        raise SystemExit(f"--speed expects numbers, got {value!r}") from None
    if len(speeds) == 1:
        speeds *= replicas
    if len(speeds) != replicas or not all(s > 0 for s in speeds):
        raise SystemExit(f"--speed needs 1 or {replicas} factors > 0, got {value!r}")
    return speeds


def shift_port(endpoint: str, offset: int) -> str:
    m = re.fullmatch(r"(.*):(\d+)", endpoint)
    if not m:
        raise SystemExit(f"--kv-events-endpoint needs a port: {endpoint!r}")
    return f"{m.group(1)}:{int(m.group(2)) + offset}"


def build_configs(args: argparse.Namespace) -> list[ReplicaConfig]:
    profile = PROFILES[args.profile]
    block_size = args.block_size or profile.block_size
    num_blocks = args.num_gpu_blocks or profile.num_gpu_blocks
    # vLLM refuses to start when max_model_len does not fit the KV cache; the simulator caps it
    # (block 0 is reserved), so any single admissible request fits when running alone.
    max_model_len = min(args.max_model_len, (num_blocks - 1) * block_size)
    loras = parse_lora_modules(args.lora_modules)
    engine = EngineConfig(
        profile=profile,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_seqs=args.max_num_seqs or profile.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_model_len=max_model_len,
        max_loras=args.max_loras if loras else 0,
        time_scale=args.time_scale,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=SchedulingPolicy(args.scheduling_policy),
    )
    transfer = None
    if args.kv_connector:
        if args.kv_connector == "shared-storage" and not args.kv_shared_dir:
            raise SystemExit("--kv-connector shared-storage needs --kv-shared-dir")
        if args.kv_transfer_bandwidth <= 0:
            raise SystemExit("--kv-transfer-bandwidth must be > 0")
        transfer = KVTransferConfig(
            args.kv_connector, args.kv_shared_dir, args.kv_transfer_bandwidth
        )
    if not 1 <= args.data_parallel_size <= MAX_RANKS:
        raise SystemExit(f"--data-parallel-size must be in 1..{MAX_RANKS}")
    base = args.base_port if args.base_port is not None else args.port
    speeds = parse_speeds(args.speed, args.replicas)
    return [
        ReplicaConfig(
            host=args.host,
            # Spaced by the rank count: rank r of a replica is named (and publishes KV
            # events) at its ports plus r, as vLLM and llm-d number them.
            port=base + i * args.data_parallel_size,
            model=args.model,
            engine=replace(engine, speed=speeds[i]),
            lora_modules=loras,
            kv_events_endpoint=shift_port(args.kv_events_endpoint, i * args.data_parallel_size)
            if args.kv_events_endpoint
            else None,
            kv_events_topic=args.kv_events_topic,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            crash_exits_process=args.replicas == 1,
            kv_transfer=transfer,
            speaks=args.engine,
            data_parallel_size=args.data_parallel_size,
        )
        for i in range(args.replicas)
    ]


async def serve(configs: list[ReplicaConfig], tokenizer: SimTokenizer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    replicas = [Replica(c, tokenizer) for c in configs]
    try:
        for r in replicas:
            await r.start()
            print(f"sim replica {r.config.address} ready", flush=True)
        await stop.wait()
    finally:
        await asyncio.gather(*(r.stop() for r in replicas), return_exceptions=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    configs = build_configs(args)
    tokenizer = SimTokenizer(args.tokenizer)
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is optional on platforms without it
        runner = asyncio.run
    try:
        runner(serve(configs, tokenizer))
    except OSError as e:
        print(f"sim: {e}", file=sys.stderr)
        return 1
    return 0
