"""Tail latency over a family of workloads: every router on N seeded draws, side by side.

Each draw of :mod:`benchmarks.family` is one traffic shape (prefix groups, chats, one-off
prompts, output lengths, think times, burstiness). Its offered rate is ``--load`` times what the
fleet serves with nothing cached (:meth:`~benchmarks.family.Shape.capacity`, the replicas'
speeds counted), so every draw loads the fleet alike whatever its prompt lengths. Per draw, per
repetition, every router gets a fresh fleet and the same requests at the same times; epp's
passive-health ejections are read from its metrics after each run (on a healthy fleet every one
of them is a healthy replica ejected).

The verdict per draw compares epp's TTFT p50 and p99 (medians over the repetitions) with the
best other router's.

Usage: ``python -m benchmarks.tails [--draws 10] [--repeat 3] [--speeds 1,1,1,1,.5,.5,.5,.5]``.
Writes ``benchmarks/results/tails[-NAME].json`` and the generated ``docs/tails[-NAME].md``.
``--merge A.json B.json --name NAME`` writes one report from runs saved by several invocations
on the same fleet (draws measured in pieces).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import routing
from benchmarks.family import FamilyWorkload, Shape, bursty_arrivals
from benchmarks.oracle import Oracle
from benchmarks.report import Row
from benchmarks.routers import EppProfile, Fleet, FleetStack, Router, available, named_routers
from epp.sim.profiles import PROFILES

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROUTERS = "epp-default,round-robin,sglang-router,vllm-router"
EPP = "epp-default"
EJECTIONS = "epp_endpoint_ejections_total"


@dataclass
class Measured:
    """One router on one draw, one repetition."""

    draw: int
    router: str
    rep: int
    row: dict[str, float | str]
    ejections: float = math.nan


@dataclass
class Result:
    command: str
    fleet: str
    load: float
    draws: dict[int, dict[str, float]] = field(default_factory=dict)
    rates: dict[int, float] = field(default_factory=dict)
    runs: list[Measured] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    # The invocations whose saved runs a --merge report combines.
    sources: list[str] = field(default_factory=list)


def ejections(stack: FleetStack) -> float:
    """Ejections epp decided so far (every epp process of the stack, summed)."""
    total = 0.0
    for _, _, metrics in stack.epp_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(EJECTIONS + "{") or line.startswith(EJECTIONS + " "):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def stage_for(shape: Shape, fleet: Fleet, args: argparse.Namespace) -> routing.Stage:
    """The draw's requests and send times (the same for every router and repetition)."""
    speeds = [fleet.speed(i) for i in range(fleet.replicas)]
    capacity = shape.capacity(PROFILES[args.profile], sum(speeds), args.time_scale)
    rate = args.load * capacity
    rng = random.Random(f"tails-arrivals/{shape.seed}")
    arrivals = bursty_arrivals(rate, args.duration, shape.burstiness, rng)
    stream = FamilyWorkload(shape).stream()
    items = [next(stream) for _ in arrivals]
    oracle = Oracle(fleet.replicas, fleet.num_gpu_blocks, fleet.block_size)
    return routing.Stage(rate, items, arrivals, oracle.replay(items))


def measure_draw(
    shape: Shape, routers: Sequence[Router], args: argparse.Namespace, result: Result
) -> None:
    workload = FamilyWorkload(shape)
    fleet = routing.make_fleet(args, workload)
    stage = stage_for(shape, fleet, args)
    result.draws[shape.seed] = shape.as_dict()
    result.rates[shape.seed] = stage.rate
    print(f"== {shape.describe()}; {stage.rate:.1f} req/s", flush=True)
    for rep in range(args.repeat):
        for router in routers:
            seen: list[float] = []

            def after_stage(
                stack: FleetStack, _row: Row, router: Router = router, seen: list[float] = seen
            ) -> None:
                if isinstance(router, EppProfile):
                    seen.append(ejections(stack))

            logs = args.workdir / f"draw-{shape.seed}" / router.name / str(rep)
            try:
                (row,) = routing.measure(router, workload, [stage], fleet, args, logs, after_stage)
            except (RuntimeError, OSError) as exc:
                why = str(exc).splitlines()[0]
                print(f"  {router.name}: failed on draw {shape.seed}: {why}", flush=True)
                result.unavailable[f"{router.name} on draw {shape.seed}"] = why
                continue
            measured = Measured(shape.seed, router.name, rep, asdict(row))
            if seen:
                measured.ejections = seen[-1]
                print(f"    epp ejections: {measured.ejections:g}", flush=True)
            result.runs.append(measured)


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summary(result: Result) -> list[dict[str, float | str]]:
    """Per draw and router: the medians over repetitions, and epp's ratios to the best other."""
    out: list[dict[str, float | str]] = []
    for draw in sorted(result.draws):
        runs = [m for m in result.runs if m.draw == draw]
        by_router: dict[str, list[Measured]] = {}
        for m in runs:
            by_router.setdefault(m.router, []).append(m)
        rows = {}
        for name, group in by_router.items():
            rows[name] = {
                key: _median([float(m.row[key]) for m in group])
                for key in ("ttft_p50", "ttft_p90", "ttft_p99", "hit_rate", "errors")
            }
            rows[name]["ejections"] = _median([m.ejections for m in group])
        # epp's variants (epp-*: profiles compared side by side) are each measured against
        # the best router that is not epp.
        others = [r for n, r in rows.items() if not _is_epp(n)]
        for name, row in rows.items():
            line: dict[str, float | str] = {"draw": draw, "router": name, **row}
            if _is_epp(name) and others:
                line["p50_vs_best"] = row["ttft_p50"] / min(r["ttft_p50"] for r in others)
                line["p99_vs_best"] = row["ttft_p99"] / min(r["ttft_p99"] for r in others)
            out.append(line)
    return out


def _is_epp(router: str) -> bool:
    return router == EPP or router.startswith("epp-")


def _f(value: float | str, digits: int = 2) -> str:
    if isinstance(value, str):
        return value
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def markdown(result: Result) -> str:
    lines = [
        "# Tail latency over a workload family",
        "",
        f"Generated by `{result.command}`; do not edit (rerun the command)."
        + "".join(f" Runs measured by `{source}`." for source in result.sources),
        "",
        f"Fleet: {result.fleet}. Offered load: {result.load:g} x the fleet's uncached "
        "capacity per draw. TTFT in seconds, medians over the repetitions; ejections: epp's "
        "passive-health ejections during the run (the fleet is healthy: each one is a "
        "healthy replica ejected).",
        "",
        "## Draws",
        "",
    ]
    for draw in sorted(result.draws):
        shape = Shape(**result.draws[draw])  # type: ignore[arg-type]
        lines.append(f"- {shape.describe()}; {result.rates[draw]:.1f} req/s")
    lines += [
        "",
        "## Results",
        "",
        "| draw | router | TTFT p50 | p90 | p99 | hit rate | errors | ejections | "
        "p50 / best other | p99 / best other |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary(result):
        lines.append(
            f"| {row['draw']} | {row['router']} | {_f(row['ttft_p50'])} | {_f(row['ttft_p90'])} "
            f"| {_f(row['ttft_p99'])} | {_f(row['hit_rate'])} | {_f(row['errors'], 0)} | "
            f"{_f(row['ejections'], 0)} | {_f(row.get('p50_vs_best', math.nan))} | "
            f"{_f(row.get('p99_vs_best', math.nan))} |"
        )
    verdicts: dict[str, list[dict[str, float | str]]] = {}
    for r in summary(result):
        if "p99_vs_best" in r:
            verdicts.setdefault(str(r["router"]), []).append(r)
    if verdicts:
        lines.append("")
    for router, rows in verdicts.items():
        p99 = [float(r["p99_vs_best"]) for r in rows]
        p50 = [float(r["p50_vs_best"]) for r in rows]
        lines.append(
            f"- {router}: TTFT p99 at most 0.8x the best other router's on "
            f"{sum(v <= 0.8 for v in p99)} of {len(p99)} draws, above 1.0x on "
            f"{sum(v > 1.0 for v in p99)}; p50 at most 0.6x on {sum(v <= 0.6 for v in p50)} "
            f"of {len(p50)}; ejections {sum(float(r['ejections']) for r in rows):g} in all."
        )
    if result.unavailable:
        lines += ["", "Not measured:", ""]
        lines += [f"- {what}: {why}" for what, why in sorted(result.unavailable.items())]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tails", description=__doc__)
    parser.add_argument("--draws", type=int, default=10, help="workload draws (seeds)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--routers", default=DEFAULT_ROUTERS)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--speeds", help="each replica's compute speed, comma list")
    parser.add_argument("--load", type=float, default=0.5, help="share of uncached capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per run")
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--name", default="", help="report suffix (docs/tails-NAME.md)")
    parser.add_argument("--workdir", type=Path, help="logs (default: a temp dir)")
    parser.add_argument("--merge", type=Path, nargs="+", help="saved results to report as one")
    ours = parser.parse_args(argv)
    # The routing benchmark's own settings (fleet, timeouts, warm-up) with its defaults.
    shared = ["--replicas", str(ours.replicas), "--profile", ours.profile]
    shared += ["--time-scale", str(ours.time_scale), "--duration", str(ours.duration)]
    if ours.speeds:
        shared += ["--speeds", ours.speeds]
    args = routing.parse_args(shared)
    for key in ("draws", "first_seed", "repeat", "routers", "load", "name", "merge"):
        setattr(args, key, getattr(ours, key))
    args.workdir = ours.workdir or Path(tempfile.mkdtemp(prefix="epp-tails-"))
    return args


def merged(paths: Sequence[Path], command: str) -> Result:
    """The runs saved by several invocations on one fleet and load, as one result."""
    parts = [json.loads(path.read_text()) for path in paths]
    result = Result(command, parts[0]["fleet"], parts[0]["load"])
    result.sources = [part["command"] for part in parts]
    for path, part in zip(paths, parts, strict=True):
        if (part["fleet"], part["load"]) != (result.fleet, result.load):
            sys.exit(f"{path}: another fleet or load than {paths[0]}")
        result.draws.update({int(k): v for k, v in part["draws"].items()})
        result.rates.update({int(k): v for k, v in part["rates"].items()})
        result.runs += [Measured(**m) for m in part["runs"]]
        result.unavailable.update(part["unavailable"])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m benchmarks.tails " + " ".join(sys.argv[1:] if argv is None else list(argv))
    if args.merge:
        result = merged(args.merge, command)
    else:
        fleet = f"{args.replicas} simulated replicas ({args.profile}, time scale "
        fleet += f"{args.time_scale:g})" + (f", speeds {args.speeds}" if args.speeds else "")
        result = Result(command, fleet, args.load)
        routers = available(named_routers(args.routers.split(",")), result.unavailable)
        print(f"tails benchmark; logs under {args.workdir}", flush=True)
        for seed in range(args.first_seed, args.first_seed + args.draws):
            measure_draw(Shape.draw(seed), routers, args, result)
    suffix = f"-{args.name}" if args.name else ""
    results = ROOT / "benchmarks" / "results" / f"tails{suffix}.json"
    results.write_text(json.dumps(asdict(result), indent=1, default=str) + "\n")
    report = markdown(result)
    (ROOT / "docs" / f"tails{suffix}.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
