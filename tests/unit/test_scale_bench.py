"""The scale benchmark, tiny: 10 replicas, 2 epp instances, a few dozen requests.

It runs the real pieces (the fleet process, epp instances on their own threads, the Redis at
127.0.0.1:6379 under a key prefix of the run's own) and checks that every column of the report
is filled with a value that makes sense, and that the generated block of the document is
replaced without touching what is written around it.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pytest
import redis

from benchmarks import scale
from epp.devstack import free_port_run
from tests.unit.conftest import SHARED_URL


def test_a_tiny_point_fills_every_column() -> None:
    try:
        redis.Redis.from_url(SHARED_URL).ping()
    except redis.exceptions.ConnectionError as exc:
        pytest.skip(f"no Redis at {SHARED_URL}: {exc}")
    settings = scale.Settings(
        replicas=10,
        epps=2,
        requests=40,
        rate=100.0,
        idle=1.0,
        interval=0.2,
        groups=4,
        base_port=free_port_run(10),
        redis_url=SHARED_URL,
    )
    point = asdict(scale.run_point(settings))
    text = scale.table([point])
    header = text.splitlines()[0]
    for _key, title, _fmt in scale.COLUMNS:
        assert title in header
    cells = [c.strip() for c in text.splitlines()[2].split("|")[1:-1]]
    missing = {title for (_k, title, _f), c in zip(scale.COLUMNS, cells, strict=True) if c == "-"}
    # Every column has a figure but the comparison with a 1-epp point, which this run lacks.
    assert missing == {"vs one process (points)"}, text
    assert all(math.isfinite(v) for v in point.values() if isinstance(v, float))
    assert 0 < point["decision_p50_us"] <= point["decision_p99_us"]
    assert point["handler_cpu_per_request_us"] >= point["decision_p50_us"] / 2
    assert point["idle_cpu_ms_per_s_per_epp"] > 0
    # Leases: each replica is scraped about once per interval by the pair, not twice.
    assert 0.5 < point["scrapes_per_replica_per_s"] * settings.interval < 1.5
    assert point["redis_ops_per_s_idle"] > 0
    assert point["redis_ops_per_request"] > 0  # every pick is shipped and read
    assert 0 <= point["propagation_p50_ms"] <= point["propagation_p99_ms"]
    # 4 groups, 40 requests: all but each group's first can hit.
    assert 0 <= point["prefix_hit_rate"] <= 36 / 40
    leftovers = redis.Redis.from_url(SHARED_URL).keys(f"{{scale-*-{settings.replicas}x2}}:*")
    assert leftovers == []


def test_the_generated_block_is_replaced_and_the_prose_kept(tmp_path: Path) -> None:
    doc = tmp_path / "scale.md"
    doc.write_text(f"# Title\n\nprose before\n\n{scale.BEGIN}\nold table\n{scale.END}\n\nafter\n")
    scale.write_doc("new table", doc)
    assert doc.read_text() == (
        f"# Title\n\nprose before\n\n{scale.BEGIN}\nnew table\n{scale.END}\n\nafter\n"
    )


def test_hit_rate_counts_repeats_on_a_replica_that_served_the_group() -> None:
    picks = [(1, "a"), (1, "a"), (1, "b"), (2, "a"), (1, "b")]
    assert scale.hit_rate(picks) == 2 / 5
