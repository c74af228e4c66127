"""The routing report's repetitions: medians, summed errors and the ranges its verdicts show."""

from __future__ import annotations

from benchmarks.report import Row, Run, median_rows, targets


def _row(router: str, rep: int, p90: float, tok_s: float, errors: int = 0) -> Row:
    return Row(
        workload="multi-turn",
        router=router,
        rate=24.0,
        sent=100,
        errors=errors,
        req_s=tok_s / 128,
        out_tok_s=tok_s,
        ttft_p50=p90 / 2,
        ttft_p90=p90,
        ttft_p99=p90 * 2,
        hit_rate=0.75,
        oracle_hit_rate=0.8,
        load_cv=0.1,
        preemptions=rep + 1,
        sim_cpu=0.3,
        router_cpu=0.2,
        send_lag=0.01 * (rep + 1),
        first_error="boom" if errors else "",
        rep=rep,
    )


def test_repetitions_become_one_median_row_per_router_and_rate() -> None:
    rows = [
        _row("epp-default", 0, 1.0, 2000),
        _row("epp-default", 1, 9.0, 1000, errors=2),  # one disturbed repetition
        _row("epp-default", 2, 2.0, 1800),
        _row("sglang-router", 0, 3.0, 1500),
    ]
    merged = median_rows(rows)
    assert [r.router for r in merged] == ["epp-default", "sglang-router"]
    ours = merged[0]
    assert (ours.ttft_p90, ours.out_tok_s) == (2.0, 1800)
    assert (ours.sent, ours.errors, ours.first_error) == (300, 2, "boom")
    assert ours.preemptions == 2
    assert isinstance(ours.preemptions, int)
    assert ours.send_lag == 0.03
    assert merged[1] == rows[3]


def test_targets_show_ranges_and_judge_on_medians() -> None:
    rows = [
        _row("epp-default", 0, 1.0, 2000),
        _row("epp-default", 1, 9.0, 1000),
        _row("epp-default", 2, 2.0, 1800),
        _row("sglang-router", 0, 2.5, 1200),
        _row("sglang-router", 1, 2.4, 1300),
        _row("sglang-router", 2, 2.6, 1100),
    ]
    run = Run(rows, "cmd", [], [], "machine", 1.0, repeat=3)
    text = "\n".join(targets(run))
    assert "medians of 3 repetitions" in text
    # p90 2.0 (1.0-9.0) against 2.5 (2.4-2.6): lower on the medians despite one bad repetition,
    # and past saturation: even the best peer's p90 is over the run's 1 s.
    assert (
        "| 2.000 (1.000-9.000) | 2.500 (2.400-2.600) (`sglang-router`) | "
        "lower (0.80x, past saturation) |"
    ) in text
    assert "| 1800 (1000-2000) | 1200 (1100-1300) | 1.50x |" in text


def test_a_single_run_reports_plain_figures() -> None:
    rows = [_row("epp-default", 0, 0.4, 2000), _row("sglang-router", 0, 0.8, 1000)]
    text = "\n".join(targets(Run(rows, "cmd", [], [], "machine", 1.0)))
    assert "repetitions" not in text
    assert "| 0.400 | 0.800 (`sglang-router`) | lower (0.50x) |" in text
    assert median_rows(rows) == rows
