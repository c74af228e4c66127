"""Learned latency on a heterogeneous fleet: epp without weights against hand-set weights,
round robin and sglang-router, and how well the latency model predicts TTFT.

The fleet is the routing benchmark's (benchmarks/routing.py) with replicas of two speeds side
by side (``--speeds``, default fast and half-speed alternating: 4 fast + 4 slow). After every
stage the script reads each epp router's ``/debug/endpoints``: the latency model's median
absolute error of the TTFT predicted at each pick against the TTFT measured, per endpoint,
and the learned capacities, grouped by the replicas' true speed. Before its first stage every
router gets the same 10 s warm-up of prompts that share no prefix with the workload
(``--warmup``, excluded from the stats), so a learner is judged after it has seen the replicas.

Usage: ``python -m benchmarks.learned [--quick] [--repeat N] [--routers a,b]
[--workloads shared-prefix,mixed] [routing benchmark options]``.
Writes ``benchmarks/results/learned-latency-bench.md`` (``--output``; raw results beside it as
``.json``, ``--results``); ``--from-json FILE[,FILE...]``
re-renders (several files: their runs merged as repetitions).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import routing
from benchmarks.report import Row, median_rows, progress_line
from benchmarks.routers import EppProfile, FleetStack, Router, available, named_routers
from benchmarks.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
SPEEDS = "1,0.5,1,0.5,1,0.5,1,0.5"
DEFAULT_ROUTERS = [
    "round-robin",
    "epp-default",
    "epp-weighted",
    "epp-learned",
    "epp-latency",
    "sglang-router",
]
RATES = {"shared-prefix": [4.0, 8.0, 12.0], "mixed": [4.0, 8.0, 12.0]}
QUICK_RATES = {"shared-prefix": [8.0], "mixed": [8.0]}
# (workload, router, against, figure, what the ratio means) for the report's target list.
CHECKS = (
    (
        "shared-prefix",
        "epp-default",
        "epp-weighted",
        "ttft_p90",
        "TTFT p90, no weights / hand-set (<= 1.05)",
    ),
    (
        "shared-prefix",
        "epp-default",
        "sglang-router",
        "ttft_p90",
        "TTFT p90, epp / sglang-router (<= 0.9)",
    ),
    (
        "shared-prefix",
        "epp-default",
        "sglang-router",
        "out_tok_s",
        "output tok/s, epp / sglang-router (> 1)",
    ),
    ("mixed", "epp-default", "round-robin", "ttft_p99", "TTFT p99, epp / round robin (<= 0.7)"),
    ("mixed", "epp-default", "round-robin", "ttft_p50", "TTFT p50, epp / round robin (<= 0.5)"),
    (
        "mixed",
        "epp-default",
        "epp-weighted",
        "ttft_p90",
        "TTFT p90, no weights / hand-set (<= 1.05)",
    ),
    ("shared-prefix", "epp-learned", "epp-weighted", "ttft_p90", "TTFT p90, learned / hand-set"),
    ("mixed", "epp-learned", "epp-weighted", "ttft_p90", "TTFT p90, learned / hand-set"),
    ("mixed", "epp-learned", "round-robin", "ttft_p99", "TTFT p99, learned / round robin"),
)


@dataclass
class Learned:
    """What one epp router's latency model said after one stage, per replica speed."""

    workload: str
    router: str
    rate: float
    rep: int
    # speed -> median over that speed's endpoints of their median absolute % error.
    error: dict[str, float] = field(default_factory=dict)
    # speed -> median learned capacity and prefill rate.
    capacity: dict[str, float] = field(default_factory=dict)
    prefill_rate: dict[str, float] = field(default_factory=dict)
    samples: int = 0


@dataclass
class Result:
    command: str
    setup: list[str]
    machine: str
    speeds: list[float]
    slo: float = 1.0
    rows: list[Row] = field(default_factory=list)
    learned: list[Learned] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    routers: dict[str, str] = field(default_factory=dict)
    repeat: int = 1


def read_learned(stack: FleetStack, row: Row, speeds: Sequence[float]) -> Learned:
    metrics = stack.epp_ports[0][2]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/debug/endpoints", timeout=5) as r:
        endpoints: dict[str, Any] = json.loads(r.read())
    by_speed: dict[str, list[dict[str, Any]]] = {}
    for i, address in enumerate(stack.replica_addresses):
        latency = (endpoints.get(address) or {}).get("latency")
        if latency:
            by_speed.setdefault(f"{speeds[i]:g}", []).append(latency)
    out = Learned(row.workload, row.router, row.rate, row.rep)
    for speed, models in by_speed.items():
        errors = [m["ttft_median_abs_error"] for m in models if m["ttft_median_abs_error"]]
        capacities = [m["capacity"] for m in models if m["capacity"]]
        rates = [m["prefill_tokens_per_second"] for m in models if m["prefill_tokens_per_second"]]
        if errors:
            out.error[speed] = statistics.median(errors)
        if capacities:
            out.capacity[speed] = statistics.median(capacities)
        if rates:
            out.prefill_rate[speed] = statistics.median(rates)
        out.samples += sum(m["ttft_samples"] for m in models)
    return out


def run(args: Any, names: Sequence[str], command: str) -> Result:
    workloads = [WORKLOADS[n](seed=args.seed) for n in args.workloads.split(",")]
    speeds = [float(v) for v in args.speeds.split(",")]
    fleet = routing.make_fleet(args, workloads[0])
    result = Result(
        command,
        routing.describe(fleet, workloads, args),
        routing.machine(),
        speeds,
        args.slo,
        repeat=args.repeat,
    )
    print("\n".join(result.setup), flush=True)
    chosen = available(named_routers(names), result.unavailable)
    result.routers.update((r.name, r.label()) for r in chosen)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="epp-learned-"))
    print(f"logs under {workdir}", flush=True)
    for workload in workloads:
        fleet = routing.make_fleet(args, workload)
        rates = (
            [float(x) for x in args.rates.split(",")]
            if args.rates
            else (QUICK_RATES if args.quick else RATES)[workload.name]
        )
        print(f"== {workload.name}: planning {len(rates)} stages ...", flush=True)
        stages = routing.plan(workload, rates, args.duration, fleet)
        for rep in range(args.repeat):
            for router in chosen:
                logs = workdir / router.name / workload.name / str(rep)

                def after_stage(
                    stack: FleetStack, row: Row, router: Router = router, rep: int = rep
                ) -> None:
                    row.rep = rep
                    if isinstance(router, EppProfile):
                        learned = read_learned(stack, row, speeds)
                        result.learned.append(learned)
                        print(f"    latency model: {describe_learned(learned)}", flush=True)

                try:
                    rows = routing.measure(router, workload, stages, fleet, args, logs, after_stage)
                except (RuntimeError, OSError) as exc:
                    why = str(exc).splitlines()[0]
                    print(f"  {router.name}: failed on {workload.name}: {why}", flush=True)
                    result.unavailable[f"{router.name} on {workload.name}"] = why
                    continue
                for row in rows:
                    row.rep = rep
                result.rows += rows
    return result


def describe_learned(learned: Learned) -> str:
    parts = []
    for speed in sorted(learned.error, key=float, reverse=True):
        capacity = learned.capacity.get(speed, math.nan)
        parts.append(
            f"speed {speed}: TTFT error {100 * learned.error[speed]:.0f}%, "
            f"capacity {capacity:.2f}, prefill {learned.prefill_rate.get(speed, 0):,.0f} tok/s"
        )
    return "; ".join(parts) + f" ({learned.samples} samples)"


def _median_learned(items: Sequence[Learned]) -> dict[tuple[str, str, float], Learned]:
    groups: dict[tuple[str, str, float], list[Learned]] = {}
    for item in items:
        groups.setdefault((item.workload, item.router, item.rate), []).append(item)
    out = {}
    for key, group in groups.items():
        merged = Learned(*key, rep=0, samples=sum(g.samples for g in group))
        for name in ("error", "capacity", "prefill_rate"):
            speeds = {s for g in group for s in getattr(g, name)}
            getattr(merged, name).update(
                {
                    s: statistics.median(
                        getattr(g, name)[s] for g in group if s in getattr(g, name)
                    )
                    for s in speeds
                }
            )
        out[key] = merged
    return out


def _fmt(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def markdown(result: Result) -> str:
    rows = median_rows(result.rows)
    learned = _median_learned(result.learned)
    lines = [
        "# Learned latency on a heterogeneous fleet: measurements",
        "",
        "Generated by `benchmarks/learned.py`; what is learned and how: "
        "[learned-latency.md](learned-latency.md).",
        "",
        f"- Command: `{result.command}`",
        f"- Machine: {result.machine}",
        *result.setup,
        f"- Repetitions: {result.repeat}"
        + (" (tables show medians)" if result.repeat > 1 else " (single run, no medians)"),
        "",
        "Routers:",
        "",
        *(f"- `{name}`: {label}" for name, label in result.routers.items()),
        *(f"- `{name}`: unavailable ({why})" for name, why in result.unavailable.items()),
        "",
    ]
    for workload in sorted({r.workload for r in rows}):
        lines += [
            f"## {workload}",
            "",
            "| router | rate | sent | errors | req/s | out tok/s | TTFT p50 | TTFT p90 | "
            f"TTFT p99 | TTFT <= {result.slo:g} s | prefix hits |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in sorted(
            (r for r in rows if r.workload == workload), key=lambda r: (r.rate, r.router)
        ):
            lines.append(
                f"| {row.router} | {row.rate:g} | {row.sent} | {row.errors} | "
                f"{row.req_s:.1f} | {row.out_tok_s:,.0f} | {_fmt(row.ttft_p50)} | "
                f"{_fmt(row.ttft_p90)} | {_fmt(row.ttft_p99)} | {100 * row.slo_met:.0f}% | "
                f"{100 * row.hit_rate:.0f}% |"
            )
        lines.append("")
        found = [v for k, v in sorted(learned.items()) if k[0] == workload]
        if found:
            speeds = sorted({s for v in found for s in v.error}, key=float, reverse=True)
            lines += [
                "Latency model after each stage (each endpoint's median absolute error of the "
                "TTFT predicted at the pick against the TTFT measured, over its last 256 "
                "requests; then the median over the endpoints of one speed):",
                "",
                "| router | rate | "
                + " | ".join(f"speed {s}: TTFT error, capacity, prefill tok/s" for s in speeds)
                + " |",
                "|---|---|" + "---|" * len(speeds),
            ]
            for v in found:
                cells = [
                    f"{100 * v.error.get(s, math.nan):.0f}%, {v.capacity.get(s, math.nan):.2f}, "
                    f"{v.prefill_rate.get(s, math.nan):,.0f}"
                    for s in speeds
                ]
                lines.append(f"| {v.router} | {v.rate:g} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join([*lines, *targets(rows)]) + "\n"


def targets(rows: Sequence[Row]) -> list[str]:
    """The issue's comparisons, rate by rate (medians over repetitions)."""
    by = {(r.workload, r.router, r.rate): r for r in rows}
    lines = ["## Against the targets", ""]
    for workload, ours, theirs, figure, label in CHECKS:
        rates = sorted({k[2] for k in by if k[0] == workload and k[1] in (ours, theirs)})
        cells = []
        for rate in rates:
            a, b = by.get((workload, ours, rate)), by.get((workload, theirs, rate))
            if a is not None and b is not None and getattr(b, figure):
                ratio = getattr(a, figure) / getattr(b, figure)
                cells.append(
                    f"{rate:g}/s {ratio:.2f} ({getattr(a, figure):.2f} vs {getattr(b, figure):.2f})"
                )
        if cells:
            lines.append(f"- {workload}, {label}: " + ", ".join(cells))
    return [*lines, ""]


def save(result: Result, path: Path) -> None:
    path.write_text(json.dumps(dataclasses.asdict(result), indent=1, allow_nan=True) + "\n")


def load(path: Path) -> Result:
    data = json.loads(path.read_text())
    data["rows"] = [Row(**r) for r in data["rows"]]
    data["learned"] = [Learned(**item) for item in data["learned"]]
    return Result(**data)


def merge(results: Sequence[Result]) -> Result:
    """Several runs as the repetitions of one (each run's repetitions numbered after the
    previous run's); set-up and machine of the first, every run's command."""
    first = results[0]
    merged = dataclasses.replace(
        first,
        command="; ".join(r.command for r in results),
        rows=[],
        learned=[],
        repeat=0,
        routers=dict(first.routers),
        unavailable=dict(first.unavailable),
    )
    for result in results:
        for row in result.rows:
            merged.rows.append(dataclasses.replace(row, rep=row.rep + merged.repeat))
        for item in result.learned:
            merged.learned.append(dataclasses.replace(item, rep=item.rep + merged.repeat))
        merged.repeat += result.repeat
        merged.routers.update(result.routers)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    names = DEFAULT_ROUTERS
    if "--routers" in given:
        at = given.index("--routers")
        names = given[at + 1].split(",")
        del given[at : at + 2]
    defaults = [
        "--speeds",
        SPEEDS,
        "--workloads",
        "shared-prefix,mixed",
        "--output",
        str(routing.RESULTS / "learned-latency-bench.md"),
        "--duration",
        "20",
        # A learner is judged after it has seen traffic: every router (peers and hand-set
        # weights alike) gets the same warm-up of prompts cached nowhere before its first
        # stage (docs/learned-latency.md).
        "--warmup",
        "10",
    ]
    args = routing.parse_args([*defaults, *given])
    if "--duration" not in given and args.quick:
        args.duration = 10.0
    command = "python -m benchmarks.learned " + " ".join(
        sys.argv[1:] if argv is None else list(argv)
    )

    def _terminate(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    if args.from_json:
        # Comma-separated: several runs merged as repetitions of one.
        result = merge([load(Path(p)) for p in str(args.from_json).split(",")])
    else:
        started = time.monotonic()
        try:
            result = run(args, names, command.strip())
        except KeyboardInterrupt:
            print("interrupted: every process started was stopped; no report written", flush=True)
            return 130
        print(f"measured in {time.monotonic() - started:.0f} s", flush=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        save(result, args.results)
    for row in median_rows(result.rows):
        print(progress_line(row))
    args.output.write_text(markdown(result))
    print(f"wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
