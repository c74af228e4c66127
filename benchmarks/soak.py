"""Soak: moderate streaming load for a long time while the fleet churns; memory, descriptors and
failed requests over time. Not part of ``make test`` (30 minutes by default).

The stack is ``epp dev``'s (:class:`epp.devstack.Stack`): Envoy, two ``epp serve`` sharing state
through a ``redis-server`` of this script's own on a free port, three simulated replicas, one
process each. The load is open loop: ``--rate`` streaming completions per second whatever the
fleet does. Every ``--cycle`` seconds the same churn runs, spread over the cycle:

* a replica crashes (SIGKILL) and returns ``--replica-down`` seconds later (a new process);
* the configuration is rewritten (``routing.fallbacks`` toggles 1 <-> 2); both epps reload it;
* Redis is SIGKILLed and started again, empty, ``--redis-down`` seconds later;
* epp1 is SIGKILLed; the supervisor (``Stack.supervise``, as in ``epp dev``) restarts it.

Every request is recorded (start, end, status, replica, error). A failed request is attributed
to the event it overlapped: in flight on epp1 when it was killed (the loss docs/active-active.md
documents), in flight on a replica when that replica crashed (its process and the response with
it are gone), else unexplained. Whether a ready replica existed at its start is counted from the
churn timeline (only one replica is ever down). Every ``--sample`` seconds: RSS and open file
descriptors of both epp processes (from /proc). epp0 is never restarted, so its series is the
one judged: after the warm-up (the first sixth of the run, at least a cycle) its maximum must be
within 10% of its minimum.

Usage: ``python -m benchmarks.soak [--duration 1800] [--rate 10]``; writes ``docs/soak.md``
and the plots ``docs/img/soak-rss.svg``, ``docs/img/soak-fds.svg``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.svgplot import line_chart
from epp.devstack import Stack, http_ok
from tests.helpers.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
# Requests of ~0.2-0.6 s (16 tokens), plenty of KV.
SIM_ARGS = ["--time-scale", "0.05", "--num-gpu-blocks", "20000"]
PREFIXES = [f"You are assistant {g}. " + "Keep answers short and polite. " * 40 for g in range(8)]


@dataclass
class Result:
    started: float
    ended: float
    status: int
    served_by: str
    error: str


@dataclass
class Event:
    at: float
    kind: str
    target: str
    until: float | None = None


def stream_completion(base: str, prompt: str, max_tokens: int = 16) -> tuple[int, str, str]:
    """(status, replica, error) of one streamed completion read to ``data: [DONE]``."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    served = ""
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        resp = conn.getresponse()
        served = resp.getheader("x-served-by") or ""
        data = resp.read()
        if resp.status != 200:
            return resp.status, served, data[:200].decode(errors="replace")
        if b"data: [DONE]" not in data:
            return 0, served, "stream ended without [DONE]"
        return 200, served, ""
    except (OSError, http.client.HTTPException) as exc:
        return 0, served, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


class Load:
    """Open loop: one request every 1/rate s, each on a pool thread; results kept in order."""

    def __init__(self, base: str, rate: float, max_tokens: int = 16) -> None:
        self.base, self.rate, self.max_tokens = base, rate, max_tokens
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(16, int(rate * 4)))
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._pool.shutdown(wait=True)

    def _one(self, i: int) -> None:
        started = time.monotonic()
        prompt = f"{PREFIXES[i % len(PREFIXES)]}request {i} {uuid.uuid4().hex}"
        status, served, error = stream_completion(self.base, prompt, self.max_tokens)
        self.results.append(Result(started, time.monotonic(), status, served, error))

    def _run(self) -> None:
        due = time.monotonic()
        i = 0
        while not self._stop.is_set():
            self._pool.submit(self._one, i)
            i += 1
            due += 1 / self.rate
            self._stop.wait(max(0.0, due - time.monotonic()))


def proc_usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a live process, from /proc."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Churn:
    """The cycle of faults; each returns when the fault is applied (restores are scheduled)."""

    def __init__(self, stack: Stack, redis: RedisServer, cycle: float, args: argparse.Namespace):
        self.stack, self.redis, self.cycle, self.args = stack, redis, cycle, args
        self.events: list[Event] = []
        self.pending: list[tuple[float, Callable[[], None]]] = []
        self.cycles = 0
        self.fallbacks = 1

    def plan(self, t0: float) -> list[tuple[float, Callable[[], None]]]:
        c = self.cycle
        return [
            (t0 + 0.15 * c, self.crash_replica),
            (t0 + 0.40 * c, self.reload),
            (t0 + 0.60 * c, self.restart_redis),
            (t0 + 0.85 * c, self.kill_epp),
        ]

    def crash_replica(self) -> None:
        name = f"sim{self.cycles % self.stack.replicas}"
        proc = self.stack.procs[name]
        proc.stopped = True  # the supervisor leaves it down until we bring it back
        now = time.monotonic()
        proc.kill()
        back = now + self.args.replica_down
        self.events.append(Event(now, "replica crash", self.replica_address(name), back))

        def restore() -> None:
            proc.respawn()
            proc.stopped = False

        self.pending.append((back, restore))

    def replica_address(self, name: str) -> str:
        return self.stack.replica_addresses[int(name.removeprefix("sim"))]

    def reload(self) -> None:
        self.fallbacks = 3 - self.fallbacks
        config = self.stack.epp_config()
        config["routing"] = {**config.get("routing", {}), "fallbacks": self.fallbacks}
        tmp = self.stack.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        tmp.replace(self.stack.config_path)  # atomic: an epp never reads half a file
        self.events.append(Event(time.monotonic(), "config reload", f"fallbacks={self.fallbacks}"))

    def restart_redis(self) -> None:
        now = time.monotonic()
        self.redis.kill()
        back = now + self.args.redis_down
        self.events.append(Event(now, "redis restart", "empty", back))

        def restore() -> None:
            self.redis.start()

        self.pending.append((back, restore))

    def kill_epp(self) -> None:
        self.events.append(Event(time.monotonic(), "epp SIGKILL", "epp1"))
        self.stack.procs["epp1"].kill()  # Stack.supervise restarts it

    def tick(self, now: float) -> None:
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, action in due:
            action()


def attribute(result: Result, events: list[Event]) -> str:
    """Which event a failed request overlapped (see the module docstring)."""
    for e in events:
        if e.kind == "epp SIGKILL" and result.started <= e.at <= result.ended:
            return "in flight on the killed epp"
    for e in events:
        overlapped = result.started <= e.at <= result.ended
        if e.kind == "replica crash" and overlapped and result.served_by in ("", e.target):
            return "in flight on the crashed replica"
    return "unexplained"


def replicas_up(at: float, events: list[Event], total: int) -> int:
    down = sum(
        1
        for e in events
        if e.kind == "replica crash" and e.at <= at < (e.until if e.until is not None else at)
    )
    return total - down


def flatness(values: list[float]) -> float:
    """(max - min) / min over the values."""
    if not values:
        return 0.0
    low = min(values)
    return (max(values) - low) / low if low else 0.0


def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="epp-soak-"))
    redis = RedisServer(workdir / "redis").start()
    stack = Stack(
        workdir,
        replicas=3,
        epp_count=2,
        redis_url=redis.url,
        sim_args=SIM_ARGS,
        sim_per_replica=True,
        config_extra={"store": {"key_prefix": f"soak-{uuid.uuid4().hex[:8]}"}},
    )
    samples: list[tuple[float, str, int, float, int]] = []  # (t, epp, pid, rss MiB, fds)
    load = Load(stack.url, args.rate)
    churn = Churn(stack, redis, args.cycle, args)
    log = open(workdir / "soak.log", "a")  # noqa: SIM115 - closed in finally

    def report(message: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {message}", file=log, flush=True)

    t0 = time.monotonic()
    try:
        stack.start(timeout=60)
        t0 = time.monotonic()
        load.start()
        end = t0 + args.duration
        next_cycle, next_sample, next_progress = t0, t0, t0 + 60
        plan: list[tuple[float, Callable[[], None]]] = []
        while (now := time.monotonic()) < end:
            if now >= next_cycle and now + args.cycle <= end:
                plan += churn.plan(now)
                churn.cycles += 1
                next_cycle = now + args.cycle
            for _, action in [p for p in plan if p[0] <= now]:
                action()
            plan = [p for p in plan if p[0] > now]
            churn.tick(now)
            stack.supervise(report)
            if now >= next_sample:
                for name in ("epp0", "epp1"):
                    proc = stack.procs[name]
                    if proc.alive():
                        try:
                            rss, fds = proc_usage(proc.popen.pid)
                        except OSError:
                            continue
                        samples.append((now - t0, name, proc.popen.pid, rss, fds))
                next_sample = now + args.sample
            if now >= next_progress:
                failed = sum(r.status != 200 for r in load.results)
                print(
                    f"{(now - t0) / 60:5.1f} min: {len(load.results)} requests, {failed} "
                    f"failed, {churn.cycles} cycles",
                    flush=True,
                )
                next_progress = now + 60
            time.sleep(0.05)
        load.stop()
        for _, action in churn.pending:
            action()
        epp_ok = all(http_ok(f"http://127.0.0.1:{m}/metrics") for _, _, m in stack.epp_ports)
    finally:
        load.stop()
        stack.stop()
        redis.stop()
        log.close()
    text = write_report(args, load.results, churn, samples, t0, epp_ok, workdir)
    print(text)
    return 0


def write_report(
    args: argparse.Namespace,
    results: list[Result],
    churn: Churn,
    samples: list[tuple[float, str, int, float, int]],
    t0: float,
    epp_ok: bool,
    workdir: Path,
) -> str:
    failed = [r for r in results if r.status != 200]
    causes: dict[str, int] = {}
    with_ready = 0
    for r in failed:
        cause = attribute(r, churn.events)
        causes[cause] = causes.get(cause, 0) + 1
        if replicas_up(r.started, churn.events, 3) > 0:
            with_ready += 1
    kinds: dict[str, int] = {}
    for e in churn.events:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1

    warm = max(args.duration / 6, args.cycle)
    judged = [s for s in samples if s[1] == "epp0" and s[0] >= warm]
    rss_flat = flatness([s[3] for s in judged])
    fd_flat = flatness([s[4] for s in judged])
    verdict_mem = rss_flat <= 0.10 and fd_flat <= 0.10
    unexplained = causes.get("unexplained", 0)

    out = ROOT / "docs" if args.write else workdir
    img = out / "img"
    img.mkdir(parents=True, exist_ok=True)
    marks = [e.at - t0 for e in churn.events if e.kind == "epp SIGKILL"]

    def series(column: int) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for s in samples:
            out.setdefault(s[1], []).append((s[0] / 60, float(s[column])))
        return out

    (img / "soak-rss.svg").write_text(
        line_chart("epp RSS (epp1 is restarted every cycle)", "minutes", "MiB", series(3), marks)
    )
    (img / "soak-fds.svg").write_text(
        line_chart("epp open file descriptors", "minutes", "fds", series(4), marks)
    )

    minute_rows = []
    for m in range(0, int(args.duration // 60) + 1, max(1, int(args.duration // 60) // 15)):
        at = [s for s in samples if s[1] == "epp0" and m * 60 <= s[0] < m * 60 + args.sample * 2]
        at1 = [s for s in samples if s[1] == "epp1" and m * 60 <= s[0] < m * 60 + args.sample * 2]
        window = [r for r in results if m * 60 <= r.started - t0 < (m + 1) * 60]
        if at:
            minute_rows.append(
                f"| {m} | {at[0][3]:.1f} | {at[0][4]} | "
                f"{f'{at1[0][3]:.1f}' if at1 else '-'} | {at1[0][4] if at1 else '-'} | "
                f"{len(window)} | {sum(r.status != 200 for r in window)} |"
            )
    load_avg = os.getloadavg()
    lines = [
        "# Soak",
        "",
        f"Generated by `python -m benchmarks.soak --duration {args.duration:g} --rate "
        f"{args.rate:g} --cycle {args.cycle:g}` ending "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({platform.machine()}, {os.cpu_count()} cores shared with other work; load average "
        f"at the end {load_avg[0]:.1f} / {load_avg[1]:.1f} / {load_avg[2]:.1f}). Stack: Envoy, "
        "two epps sharing a Redis of the script's own, three simulated replicas (one process "
        f"each); open-loop streaming completions (16 tokens). Logs were in `{workdir}`.",
        "",
        "## Verdict",
        "",
        f"- Requests: {len(results)}, failed: {len(failed)} "
        f"({', '.join(f'{n} {c}' for c, n in sorted(causes.items())) or 'none'}); "
        f"a ready replica existed at the start of {with_ready} of the failed ones.",
        f"- **Unexplained failures: {unexplained}** "
        f"({'PASS' if unexplained == 0 else 'FAIL'}: every failure overlapped an epp being "
        "SIGKILLed or the replica serving it crashing)."
        if unexplained == 0
        else f"- **Unexplained failures: {unexplained}** (FAIL).",
        f"- Memory and descriptors of epp0 (never restarted) after the {warm / 60:.1f}-minute "
        f"warm-up: RSS {min(s[3] for s in judged):.1f}-{max(s[3] for s in judged):.1f} MiB "
        f"({rss_flat:.1%} spread), fds {min(s[4] for s in judged)}-{max(s[4] for s in judged)} "
        f"({fd_flat:.1%}): **{'flat within 10%' if verdict_mem else 'NOT flat within 10%'}**."
        if judged
        else "- No samples after the warm-up (run longer).",
        f"- Both epps answering at the end: {epp_ok}.",
        "",
        "## Churn",
        "",
        "| event | count |",
        "|---|---|",
        *[f"| {k} | {n} |" for k, n in kinds.items()],
        "",
        "## Over time",
        "",
        "| minute | epp0 RSS MiB | epp0 fds | epp1 RSS MiB | epp1 fds | requests | failed |",
        "|---|---|---|---|---|---|---|",
        *minute_rows,
        "",
        "![RSS](img/soak-rss.svg)",
        "",
        "![fds](img/soak-fds.svg)",
        "",
        "(grey lines: epp1 SIGKILLed; it is restarted and its series starts again.)",
        "",
        "## Failed requests",
        "",
        "| t (s) | status | replica | cause | error |",
        "|---|---|---|---|---|",
        *[
            f"| {r.started - t0:.1f} | {r.status} | {r.served_by or '-'} | "
            f"{attribute(r, churn.events)} | {r.error[:80].replace('|', '/')} |"
            for r in failed[:40]
        ],
        "",
    ]
    text = "\n".join(lines)
    (out / "soak.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800, help="seconds (default 1800)")
    parser.add_argument("--rate", type=float, default=10, help="requests per second")
    parser.add_argument("--cycle", type=float, default=60, help="seconds per churn cycle")
    parser.add_argument("--sample", type=float, default=10, help="seconds between samples")
    parser.add_argument("--replica-down", type=float, default=5.0)
    parser.add_argument("--redis-down", type=float, default=2.0)
    parser.add_argument(
        "--no-write", dest="write", action="store_false", help="report into the work dir only"
    )
    raise SystemExit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
