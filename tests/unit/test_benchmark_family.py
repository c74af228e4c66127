"""The workload family behind the tail benchmark: a draw is a pure function of its seed, draws
differ, the request mix follows the draw, and arrivals have the drawn burstiness."""

from __future__ import annotations

import itertools
import json
import random
import statistics

from benchmarks.family import FamilyWorkload, Shape, bursty_arrivals
from benchmarks.routing import Stage
from benchmarks.tails import Measured, Result, markdown, summary
from epp.sim.profiles import PROFILES


def test_a_draw_depends_on_its_seed_alone() -> None:
    assert Shape.draw(4) == Shape.draw(4)
    shapes = {Shape.draw(seed) for seed in range(10)}
    assert len(shapes) == 10
    first = [i.request.body for i in itertools.islice(FamilyWorkload(Shape.draw(4)).stream(), 50)]
    again = [i.request.body for i in itertools.islice(FamilyWorkload(Shape.draw(4)).stream(), 50)]
    assert first == again


def test_the_mix_follows_the_draw() -> None:
    shape = Shape.draw(7)
    items = list(itertools.islice(FamilyWorkload(shape).stream(), 600))
    chats = [i for i in items if i.follows is not None]
    unique = [i for i in items if i.key.startswith("unique-")]
    assert abs(len(chats) / len(items) - shape.chat_share) < 0.08
    assert abs(len(unique) / len(items) - shape.unique_share) < 0.08
    # One-off prompts share nothing: each has its own key.
    assert len({i.key for i in unique}) == len(unique)
    # Chat turns wait for the previous reply, then think.
    assert any(i.think > 0 for i in chats) == (shape.think_seconds > 0)
    stage = Stage(1.0, items, [0.0] * len(items), 0.0)
    think = stage.think()
    assert think is not None
    assert all(t == 0 for t, i in zip(think, items, strict=True) if i.follows is None)
    # Output lengths vary around the draw's mean.
    outputs = [json.loads(i.request.body)["max_tokens"] for i in items]
    assert len(set(outputs)) > 10
    assert 0.5 < statistics.median(outputs) / shape.output_tokens < 2.0


def test_arrivals_have_the_drawn_burstiness_and_rate() -> None:
    for cv in (1.0, 3.0):
        times = bursty_arrivals(20.0, 500.0, cv, random.Random(1))
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert abs(len(times) / 500.0 - 20.0) < 2.0
        assert abs(statistics.pstdev(gaps) / statistics.fmean(gaps) - cv) < 0.25 * cv


def test_capacity_falls_with_longer_prompts_and_rises_with_replicas() -> None:
    profile = PROFILES["h100"]
    shape = Shape.draw(0)
    longer = Shape(**{**shape.as_dict(), "system_tokens": shape.system_tokens * 4})
    assert longer.capacity(profile, 8, 3.0) < shape.capacity(profile, 8, 3.0)
    assert shape.capacity(profile, 8, 3.0) == 2 * shape.capacity(profile, 4, 3.0)


def _run(draw: int, router: str, rep: int, p50: float, p99: float) -> Measured:
    row = {"ttft_p50": p50, "ttft_p90": p99, "ttft_p99": p99, "hit_rate": 0.5, "errors": 0.0}
    return Measured(draw, router, rep, row, 0.0 if router == "epp-default" else float("nan"))


def test_the_verdict_compares_epp_with_the_best_other_router_per_draw() -> None:
    result = Result("cmd", "fleet", 0.5, {0: Shape.draw(0).as_dict()}, {0: 3.0})
    result.runs = [
        _run(0, "epp-default", 0, 0.1, 1.0),
        _run(0, "epp-default", 1, 0.3, 3.0),  # median of two: 0.2 / 2.0
        _run(0, "round-robin", 0, 0.5, 2.5),
        _run(0, "sglang-router", 0, 0.4, 4.0),
    ]
    (epp,) = [r for r in summary(result) if r["router"] == "epp-default"]
    assert epp["p50_vs_best"] == 0.2 / 0.4
    assert epp["p99_vs_best"] == 2.0 / 2.5
    assert "at most 0.8x the best other router's on 1 of 1 draws" in markdown(result)
