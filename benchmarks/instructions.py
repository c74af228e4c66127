"""Instructions per request of epp's handler under callgrind, checked against a stored baseline.

The in-process handler benchmark (``benchmarks/handler_cpu.py``: the messages Envoy sends for
one request, through the stream handler, without gRPC or Envoy) is run under
``valgrind --tool=callgrind`` by ``benchmarks/instructions_loop.py``, which frames windows of
requests so that only their instructions are counted. An instruction count does not depend on
what else the machine runs, and with the loop's sources of variation removed (clocks, the
picker's tie-break, string hashing) it repeats exactly from run to run, so a change that makes
a request dearer shows at once, where CPU times swing by tens of percent on a shared machine.

Each point's figure is the median over its windows of the window's instructions divided by its
requests: work that comes in lumps (a young garbage collection, the plugin clock's bucket
counting every 4096 laps) falls into some windows and not others, and the median leaves it out
wherever it falls.

The figures are compared with ``benchmarks/baselines/instructions.json``; the command fails
(exit status 1) when a point costs more than the baseline's tolerance above it. A table is
printed and written to ``benchmarks/results/instructions.md``.

Usage: ``python -m benchmarks.instructions [--windows 9] [--window 20] [--warmup 50]
[--update-baseline]``; ``--update-baseline`` records this run's figures as the new baseline
(keeping its tolerance) instead of checking them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.instructions_loop import START_MARK, STOP_MARK

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "benchmarks" / "baselines" / "instructions.json"
REPORT = ROOT / "benchmarks" / "results" / "instructions.md"
POINTS = ["buffered 1KB", "buffered 8KB", "full-duplex 1KB", "full-duplex 8KB"]
# Requests before the windows, windows per point (odd: the median is one of them), requests
# per window.
DEFAULT_SETTINGS = {"warmup": 50, "windows": 9, "window": 20}
# Growth over the baseline that fails the check, unless the baseline file states its own.
DEFAULT_TOLERANCE = 0.02
# The libraries whose code runs per request besides epp's: a baseline recorded with other
# versions (or another interpreter) may differ for that reason alone.
LIBRARIES = ["protobuf", "prometheus-client", "xxhash", "msgspec"]


@dataclass(frozen=True, slots=True)
class Figure:
    """One point's instructions per request: the median window's, and the spread."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, counts: Sequence[int], window: int) -> Figure:
        per_request = [count / window for count in counts]
        return cls(statistics.median(per_request), min(per_request), max(per_request))


@dataclass(frozen=True, slots=True)
class Verdict:
    point: str
    baseline: float | None
    measured: float
    tolerance: float

    @property
    def change(self) -> float | None:
        """Relative change against the baseline (None: the baseline lacks this point)."""
        return None if self.baseline is None else self.measured / self.baseline - 1

    @property
    def failed(self) -> bool:
        change = self.change
        return change is None or change > self.tolerance


def summary(dump: str) -> int:
    """The instructions counted in one callgrind dump (its ``summary:`` line)."""
    for line in dump.splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise ValueError("not a callgrind dump: no 'summary:' line")


def compare(
    measured: Mapping[str, float], baseline: Mapping[str, float], tolerance: float
) -> list[Verdict]:
    return [
        Verdict(point, baseline.get(point), value, tolerance) for point, value in measured.items()
    ]


def environment(valgrind: str) -> dict[str, str]:
    """What the counts depend on besides epp's code."""
    version = subprocess.run([valgrind, "--version"], capture_output=True, text=True, check=True)
    found = {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "libc": " ".join(platform.libc_ver()),
        "valgrind": version.stdout.strip(),
    }
    return found | {name: metadata.version(name) for name in LIBRARIES}


def measure(
    valgrind: str, points: Sequence[str], warmup: int, windows: int, window: int
) -> dict[str, Figure]:
    """Run the loop under callgrind; each point's figure from its windows' dumps."""
    # Every .pyc written afresh, the same way each run: the bytes of the code objects loaded
    # decide where later objects land in the heap, which moves the counts by up to ~0.1%, and
    # a .pyc written by an import differs from one written by compileall (marshal's output
    # depends on reference counts).
    compileall = [sys.executable, "-m", "compileall", "-q", "-f", "epp", "benchmarks"]
    subprocess.run(compileall, cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory(prefix="epp-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        argv = [
            valgrind,
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            f"--zero-before={START_MARK}",
            f"--dump-before={STOP_MARK}",
            sys.executable,
            "-m",
            "benchmarks.instructions_loop",
            f"--warmup={warmup}",
            f"--windows={windows}",
            f"--window={window}",
            *points,
        ]
        # A fixed environment: os.environ's copy of it is part of the heap, whose layout moves
        # the counts a little.
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"callgrind run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        # Dumps are numbered in the order they were written: point by point, window by window.
        dumps = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        if len(dumps) != len(points) * windows:
            sys.exit(
                f"expected {len(points) * windows} window dumps, got {len(dumps)}: "
                f"is {START_MARK} or {STOP_MARK} called outside the windows?"
            )
        counts = [summary(p.read_text()) for p in dumps]
    return {
        point: Figure.of(counts[i * windows : (i + 1) * windows], window)
        for i, point in enumerate(points)
    }


def table(figures: Mapping[str, Figure], verdicts: Sequence[Verdict]) -> str:
    lines = [
        "| mode, prompt | baseline | this run | change | windows' range |",
        "|---|---|---|---|---|",
    ]
    for verdict in verdicts:
        figure = figures[verdict.point]
        baseline = "none" if verdict.baseline is None else f"{verdict.baseline:,.0f}"
        change = "" if verdict.change is None else f"{verdict.change:+.2%}"
        flag = " **over**" if verdict.failed else ""
        lines.append(
            f"| {verdict.point} | {baseline} | {figure.median:,.0f} | {change}{flag} "
            f"| {figure.low:,.0f}-{figure.high:,.0f} |"
        )
    return "\n".join(lines)


def report(
    figures: Mapping[str, Figure],
    verdicts: Sequence[Verdict],
    tolerance: float,
    settings: Mapping[str, int],
    found: Mapping[str, str],
    recorded: Mapping[str, str],
) -> str:
    """The report file: the table, how it was made and what it was made with."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    differs = [f"{k} {recorded.get(k)} -> {v}" for k, v in found.items() if recorded.get(k) != v]
    return "\n".join(
        [
            "# Instructions per request (callgrind)",
            "",
            f"Generated by `python -m benchmarks.instructions` ({when}); see docs/instructions.md.",
            f"Instructions per request, median of {settings['windows']} windows of "
            f"{settings['window']} requests after {settings['warmup']} warm-up requests; "
            f"tolerance {tolerance:.0%} over `benchmarks/baselines/instructions.json`.",
            "",
            table(figures, verdicts),
            "",
            "Environment: " + ", ".join(f"{k} {v}" for k, v in found.items()) + ".",
            "Differs from the baseline's: " + ("; ".join(differs) if differs else "nothing") + ".",
            "",
        ]
    )


def load_baseline(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"tolerance": DEFAULT_TOLERANCE, "environment": {}, "instructions_per_request": {}}
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in DEFAULT_SETTINGS.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--point", action="append", choices=POINTS, help="default: all")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--report", type=Path, default=REPORT)
    parser.add_argument(
        "--update-baseline",
        action="store_true",
        help="record this run's figures as the baseline instead of checking them",
    )
    args = parser.parse_args()
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    points = args.point or POINTS
    settings: dict[str, int] = {name: getattr(args, name) for name in DEFAULT_SETTINGS}
    baseline = load_baseline(args.baseline)
    tolerance = float(baseline["tolerance"])
    found = environment(valgrind)
    figures = measure(valgrind, points, **settings)
    measured = {point: round(figure.median) for point, figure in figures.items()}
    if args.update_baseline:
        recorded = baseline["instructions_per_request"] | measured
        baseline = {"tolerance": tolerance, "environment": found, "settings": settings}
        baseline["instructions_per_request"] = recorded
        args.baseline.parent.mkdir(parents=True, exist_ok=True)
        args.baseline.write_text(json.dumps(baseline, indent=2) + "\n")
    verdicts = compare(measured, baseline["instructions_per_request"], tolerance)
    text = report(figures, verdicts, tolerance, settings, found, baseline["environment"])
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    print(text)
    failed = [v.point for v in verdicts if v.failed]
    if failed:
        sys.exit(
            f"instructions per request over the baseline by more than {tolerance:.0%} (or no "
            f"baseline): {', '.join(failed)}. If the change is meant, record a new baseline: "
            "python -m benchmarks.instructions --update-baseline (docs/instructions.md)."
        )


if __name__ == "__main__":
    main()
