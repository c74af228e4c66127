"""A rolling upgrade: an epp of the release before schema versions and a current one share a
real Redis under load, each a process of its own, and each gets everything the other shares."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.unit.conftest import SHARED_URL
from tests.unit.upgrade_member import complete

PICKS = 2000
ROOT = Path(__file__).resolve().parents[2]


async def _member(prefix: str, me: str, other: str, legacy: bool) -> asyncio.subprocess.Process:
    argv = [
        *("-m", "tests.unit.upgrade_member", "--url", SHARED_URL, "--prefix", prefix),
        *("--me", me, "--other", other, "--picks", str(PICKS)),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        *(["--legacy"] if legacy else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )


async def _report(process: asyncio.subprocess.Process) -> dict[str, Any]:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 60)
    assert line, f"the member exited with {await process.wait()} before reporting"
    report: dict[str, Any] = json.loads(line)
    return report


async def test_previous_and_current_encodings_share_one_redis(prefix: str) -> None:
    old = await _member(prefix, "a", "b", legacy=True)
    new = await _member(prefix, "b", "a", legacy=False)
    try:
        seen_by_old, seen_by_new = await asyncio.gather(_report(old), _report(new))
    finally:
        for process in (old, new):
            assert process.stdin is not None
            process.stdin.close()
        codes = [await asyncio.wait_for(p.wait(), 30) for p in (old, new)]
    # Every insertion, session, in-flight count, queued demand and endpoint state crossed in
    # both directions, and neither side refused anything the other wrote.
    assert complete(seen_by_old, PICKS), seen_by_old
    assert complete(seen_by_new, PICKS), seen_by_new
    assert seen_by_old["rejected"] == 0, seen_by_old
    assert seen_by_new["rejected"] == 0, seen_by_new
    assert codes == [0, 0]
