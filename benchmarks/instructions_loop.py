"""The request loop that ``benchmarks/instructions.py`` runs under callgrind.

For each point (body mode and prompt size) a fresh router is built as in
``benchmarks/handler_cpu.py``, warmed up, and then driven through ``--windows`` windows of
``--window`` requests each. Each window is framed by two libc calls made nowhere else in the
process: :data:`START_MARK` just before its first request, :data:`STOP_MARK` just after its last.
Callgrind is told to zero its counters when the first is entered and to dump them when the
second is, so each window gets a dump of exactly its own instructions: interpreter start-up,
imports, set-up and the building of each window's messages are not counted.

What would make the counts differ from run to run is removed here:

- every clock epp reads advances by a fixed step per read instead of with the wall clock
  (under callgrind the process runs ~50 times slower, so time-driven work would otherwise
  fall into a window at random);
- the max-score picker's tie-break draws from a seeded generator (the default profile, with
  ``seed: 0``), so the same endpoints are picked in every run;
- string hashing is fixed by ``PYTHONHASHSEED=0``, which this script insists on.

Usage (through ``python -m benchmarks.instructions``, which runs it under valgrind):
``python -m benchmarks.instructions_loop --warmup N --windows N --window N POINT...``,
each POINT a handler_cpu key such as ``"buffered 1KB"``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time

# The libc functions whose entry starts (zeroes) and ends (dumps) a window; os.getppid and
# os.getpgrp call them, and neither epp nor the interpreter does on its own.
START_MARK = "getppid"
STOP_MARK = "getpgrp"

# Seconds each clock advances per read: epp reads ~25 clocks a request, so a request takes
# ~125 µs of this time, about its CPU time outside valgrind.
CLOCK_STEP = 5e-6
# Where the wall clock starts (2027-01-15 UTC); the other clocks start at zero.
EPOCH = 1.8e9


def fix_clocks() -> None:
    """Replace the clocks in :mod:`time` with counters that advance by :data:`CLOCK_STEP` on
    every read. Each is a C iterator's ``__next__``, so a read costs about what the real
    clock's call does and runs no Python frame."""
    for name, start in (("time", EPOCH), ("monotonic", 0.0), ("perf_counter", 0.0)):
        setattr(time, name, itertools.count(start, CLOCK_STEP).__next__)
    step_ns = round(CLOCK_STEP * 1e9)
    for name, start in (("time", EPOCH), ("monotonic", 0.0), ("perf_counter", 0.0)):
        setattr(time, f"{name}_ns", itertools.count(round(start * 1e9), step_ns).__next__)


def run(points: list[str], warmup: int, windows: int, window: int) -> None:
    """For each point, warm up a fresh router on its requests, then drive the counted windows.

    epp is imported here, after :func:`fix_clocks`: some of its functions bind a clock as a
    default argument when their module is imported."""
    from benchmarks.handler_cpu import build_router, completion_request, drive, messages
    from epp.config import DEFAULT_PROFILE
    from epp.gc_tuning import settle_heap

    profile = [
        {**entry, "parameters": {"seed": 0}} if entry["plugin"] == "max-score-picker" else entry
        for entry in DEFAULT_PROFILE
    ]
    for point in points:
        mode, size = point.split(" ")
        router = asyncio.run(build_router({"profiles": {"default": profile}}))
        body = completion_request(size)
        drive(router, [messages(i, body, mode) for i in range(warmup)])
        # As epp serve does once started: what exists now is frozen out of the collector's sight.
        settle_heap()
        for k in range(windows):
            first = warmup + k * window
            batch = [messages(first + i, body, mode) for i in range(window)]
            os.getppid()  # START_MARK
            drive(router, batch)
            os.getpgrp()  # STOP_MARK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, required=True, help="requests before the windows")
    parser.add_argument("--windows", type=int, required=True)
    parser.add_argument("--window", type=int, required=True, help="requests per window")
    parser.add_argument("point", nargs="+", help='a body mode and a prompt size: "buffered 1KB"')
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        parser.error("run with PYTHONHASHSEED=0 (string hashes would differ from run to run)")
    fix_clocks()
    run(args.point, args.warmup, args.windows, args.window)


if __name__ == "__main__":
    main()
