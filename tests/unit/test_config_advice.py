"""Valid configurations that cannot do what they name get a warning from ``epp check-config``
(exit 0 still), and a configuration that can gets none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epp.config import parse_config
from epp.config_advice import advice
from tests.unit.test_check_config import BASE, check

CRITICAL = {"critical": {"priority": 10, "ttft_ms": 1500}, "batch": -1}
TARGET_FILTER = {
    "profile": "slo",
    "profiles": {
        "slo": [
            {"plugin": "prefix-cache-scorer"},
            {"plugin": "predicted-latency-scorer"},
            {"plugin": "latency-target-filter"},
            {"plugin": "max-score-picker"},
        ]
    },
}


def warnings(**sections: Any) -> list[str]:
    return advice(parse_config({**BASE, **sections}))


def test_queue_mode_without_a_per_replica_limit_protects_nothing() -> None:
    (warning,) = warnings(admission={"mode": "queue"})
    assert "neither admission.max_requests nor admission.max_tokens" in warning
    assert "queue_threshold (5)" in warning
    assert warnings(admission={"mode": "queue", "max_requests": 6}) == []


def test_queue_mode_with_objectives_and_no_limits_protects_the_higher_priorities() -> None:
    """No limit to guess: objectives at two priorities are what admission keeps room for, and
    their latency targets are read by admission even when no plugin reads them."""
    assert warnings(admission={"mode": "queue"}, request={"objectives": CRITICAL}) == []
    single = {"objectives": {"critical": {"priority": 10, "ttft_ms": 1500}}}
    (warning,) = [
        w
        for w in warnings(admission={"mode": "queue"}, request=single)
        if w.startswith("admission.mode is queue")
    ]
    assert "name objectives at two or more priorities" in warning


def test_a_reserve_without_a_limit_reserves_nothing() -> None:
    (warning,) = warnings(admission={"mode": "shed", "sheddable_reserve": 0.3})
    assert "nothing is reserved" in warning
    assert warnings(admission={"mode": "shed", "sheddable_reserve": 0.3, "max_tokens": 9000}) == []


def test_priorities_without_admission_change_nothing() -> None:
    objectives = {"critical": 10, "batch": -1}
    (warning,) = warnings(admission={"mode": "off"}, request={"objectives": objectives})
    assert "admission.mode is off" in warning
    assert warnings(admission={"mode": "shed"}, request={"objectives": objectives}) == []


def test_latency_targets_no_plugin_reads_are_only_counted() -> None:
    request = {"objectives": CRITICAL}
    admission = {"mode": "shed"}
    (warning,) = warnings(request=request, admission=admission)
    assert "request.objectives critical set latency targets" in warning
    assert "'default'" in warning
    assert warnings(request=request, admission=admission, scheduling=TARGET_FILTER) == []


def test_check_config_prints_the_warnings_and_still_exits_0(tmp_path: Path) -> None:
    done = check(tmp_path, {**BASE, "admission": {"mode": "queue"}})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith(
        "admission.mode is queue with neither admission.max_requests "
        "nor admission.max_tokens: held requests are released whenever a "
        "replica has fewer than queue_threshold (5) waiting and KV below "
        "kv_threshold (0.8), so critical requests queue behind the batch "
        "work admitted before them; name objectives at two or more priorities in "
        "request.objectives (with ttft_ms targets) so admission keeps room for the higher "
        "ones, or set a per-replica limit and sheddable_reserve (docs/admission.md)"
    )
    assert ": warning: " in lines[0]
    assert lines[-1].endswith(": valid")
