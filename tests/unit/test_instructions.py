"""The callgrind benchmark's arithmetic and gate (benchmarks/instructions.py), without valgrind:
reading a dump, a point's figure from its windows, the verdict against the baseline, the
committed baseline itself, and the loop's fixed clocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.instructions import (
    BASELINE,
    DEFAULT_SETTINGS,
    POINTS,
    ROOT,
    Figure,
    compare,
    summary,
)
from benchmarks.instructions_loop import CLOCK_STEP, EPOCH, fix_clocks

DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 9645
cmd:  python -m benchmarks.instructions_loop buffered 1KB
part: 1

desc: Trigger: --dump-before=getpgrp

positions: line
events: Ir
summary: 7088603


ob=(10) math.cpython-311-x86_64-linux-gnu.so
fn=(13248) math_exp
1254 60
totals: 18367358
"""


def test_a_dump_counts_its_summary_line() -> None:
    assert summary(DUMP) == 7_088_603


def test_text_without_a_summary_is_not_taken_for_a_dump() -> None:
    with pytest.raises(ValueError, match="summary"):
        summary(DUMP.replace("summary:", "total:"))


def test_a_lumpy_window_does_not_move_the_figure() -> None:
    # Nine windows of 20 requests; one holds a garbage collection worth 2,000,000 instructions.
    counts = [14_000_000 + 20 * k for k in range(8)] + [16_000_000]
    figure = Figure.of(counts, window=20)
    assert figure.median == 700_004
    assert (figure.low, figure.high) == (700_000, 800_000)


def test_growth_beyond_the_tolerance_fails_and_within_it_passes() -> None:
    baseline = {"buffered 1KB": 700_000.0, "buffered 8KB": 900_000.0, "full-duplex 1KB": 1e6}
    measured = {"buffered 1KB": 714_001.0, "buffered 8KB": 917_900.0, "full-duplex 1KB": 5e5}
    verdicts = {v.point: v for v in compare(measured, baseline, tolerance=0.02)}
    assert verdicts["buffered 1KB"].failed  # +2.0001%
    assert not verdicts["buffered 8KB"].failed  # +1.99%
    assert not verdicts["full-duplex 1KB"].failed  # cheaper: reported, not failed
    assert verdicts["full-duplex 1KB"].change == pytest.approx(-0.5)


def test_a_point_missing_from_the_baseline_fails() -> None:
    (verdict,) = compare({"full-duplex 8KB": 1.0}, {"buffered 1KB": 1.0}, tolerance=0.02)
    assert verdict.change is None
    assert verdict.failed


def test_the_committed_baseline_covers_every_point_as_measured_by_default() -> None:
    baseline = json.loads(BASELINE.read_text())
    assert 0 < baseline["tolerance"] <= 0.05
    counts = baseline["instructions_per_request"]
    assert sorted(counts) == sorted(POINTS)
    # A request runs a few hundred thousand instructions; 8 KB costs more than 1 KB.
    assert all(100_000 < counts[p] < 10_000_000 for p in POINTS)
    for mode in ("buffered", "full-duplex"):
        assert counts[f"{mode} 8KB"] > counts[f"{mode} 1KB"]
    # Recorded with the windows the command uses unless told otherwise.
    assert baseline["settings"] == DEFAULT_SETTINGS


def test_fixed_clocks_advance_one_step_per_read(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"]
    for name in names:  # put back after the test
        monkeypatch.setattr(time, name, getattr(time, name))
    fix_clocks()
    assert [time.time(), time.time()] == [EPOCH, EPOCH + CLOCK_STEP]
    assert [time.perf_counter(), time.perf_counter()] == [0.0, CLOCK_STEP]
    assert time.monotonic() == 0.0
    assert [time.monotonic_ns(), time.monotonic_ns()] == [0, round(CLOCK_STEP * 1e9)]
    assert time.time_ns() == round(EPOCH * 1e9)


def test_the_loop_refuses_to_run_with_random_string_hashes() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "benchmarks.instructions_loop", "buffered 1KB"]
    argv += ["--warmup=1", "--windows=1", "--window=1"]
    done = subprocess.run(argv, cwd=Path(ROOT), env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert "PYTHONHASHSEED=0" in done.stderr
