"""Tenant budgets' ledger with a fake clock: sliding windows, leases, corrections, local mode."""

from __future__ import annotations

import pytest

from epp.admission.budgets import (
    BUCKETS,
    SLICE_SECONDS,
    BudgetPolicy,
    Budgets,
    Charge,
    Limits,
    Refusal,
    Window,
    duration,
)
from epp.config import ConfigError, parse_config

MINIMAL = {"models": {"m": {"pools": ["p"]}}, "pools": {"p": {"endpoints": ["127.0.0.1:1"]}}}


def ledger(rpm: int = 0, tpm: int = 0, tenant: str = "evals") -> Budgets:
    b = Budgets(BudgetPolicy({tenant: Limits(rpm, tpm)}))
    b.grouped = True  # as under a sync: what is charged is kept for the group
    return b


def admitted(verdict: Charge | Refusal | None) -> Charge:
    assert isinstance(verdict, Charge), verdict
    return verdict


def refused(verdict: Charge | Refusal | None) -> Refusal:
    assert isinstance(verdict, Refusal), verdict
    return verdict


def test_a_window_counts_for_at_least_its_length_then_forgets() -> None:
    w = Window(60.0)
    w.add(0.0, 5)
    w.add(30.0, 3)
    assert w.seconds_until_freed(40.0, 4) == pytest.approx(21.0)  # t=0's 5 leave at 61
    assert w.seconds_until_freed(40.0, 6) == pytest.approx(51.0)  # and t=30's at 91
    assert w.seconds_until_freed(40.0, 9) == float("inf")
    assert w.seconds_until_empty(40.0) == pytest.approx(51.0)
    assert w.total(59.9) == 8
    assert w.total(60.5) == 8  # the bucket of t=0 still counts: never less than a minute
    assert w.total(61.0) == 3


def test_requests_beyond_the_limit_are_refused_with_retry_after_and_headers() -> None:
    b = ledger(rpm=10)
    for i in range(10):
        admitted(b.charge("evals", 100, float(i)))
    no = refused(b.charge("evals", 100, 20.0))
    assert no.kind == "requests"
    assert no.retry_after == 41  # t=0's request leaves the window at 61
    error = no.error()
    assert error.status == 429
    assert error.type == "rate_limit_error"
    assert error.code == "rate_limit_exceeded"
    assert error.headers["retry-after"] == "41"
    assert error.headers["x-epp-request-dropped-reason"] == "rejected-budget"
    assert error.headers["x-ratelimit-limit-requests"] == "10"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert error.headers["x-ratelimit-reset-requests"] == "50s"  # t=9's leaves at 70
    assert "x-ratelimit-limit-tokens" not in error.headers  # no token limit configured
    # Sliding: one slot frees per second from t=61 on.
    admitted(b.charge("evals", 100, 61.0))
    refused(b.charge("evals", 100, 61.5))
    admitted(b.charge("evals", 100, 62.0))


def test_other_tenants_get_the_default_budget_each_and_unlimited_tenants_none() -> None:
    b = Budgets(BudgetPolicy({"evals": Limits(rpm=1)}, default=Limits(rpm=2)))
    admitted(b.charge("evals", 1, 0.0))
    refused(b.charge("evals", 1, 0.0))
    for tenant in ("a", "b"):
        admitted(b.charge(tenant, 1, 0.0))
        admitted(b.charge(tenant, 1, 0.0))
        refused(b.charge(tenant, 1, 0.0))
    assert Budgets(BudgetPolicy({"evals": Limits(rpm=1)})).charge("other", 1, 0.0) is None


def test_tokens_are_charged_at_admission_and_corrected_by_the_usage() -> None:
    b = ledger(tpm=1000)
    first = admitted(b.charge("evals", 600, 0.0))
    assert first.headers["x-ratelimit-remaining-tokens"] == "400"
    no = refused(b.charge("evals", 600, 1.0))
    assert no.kind == "tokens"
    assert no.error().headers["x-ratelimit-remaining-tokens"] == "400"
    b.correct(first, 150)  # the response used 150 of the 600 charged
    assert b.remaining("evals", "tokens", 2.0)[0] == 850
    admitted(b.charge("evals", 600, 2.0))
    assert b.remaining("evals", "tokens", 3.0)[0] == 250


def test_a_refund_gives_back_both_budgets() -> None:
    b = ledger(rpm=1, tpm=100)
    charge = admitted(b.charge("evals", 50, 0.0))
    refused(b.charge("evals", 50, 0.0))
    b.refund(charge)
    admitted(b.charge("evals", 50, 0.0))


def test_a_refusal_by_one_budget_spends_nothing_from_the_other() -> None:
    b = ledger(rpm=5, tpm=100)
    admitted(b.charge("evals", 100, 0.0))
    refused(b.charge("evals", 1, 0.0))
    assert b.remaining("evals", "requests", 0.0)[0] == 4


def test_local_mode_spends_at_most_the_share_of_the_processes_last_seen() -> None:
    b = ledger(rpm=10, tpm=1000)
    b.members = 2  # as the last sync saw the group; then redis went away (shared stays False)
    for _ in range(5):
        admitted(b.charge("evals", 10, 0.0))
    no = refused(b.charge("evals", 10, 0.0))
    assert no.error().headers["x-ratelimit-remaining-requests"] == "0"
    assert b.remaining("evals", "tokens", 0.0)[0] == 450  # 1000 / 2 - 5 x 10


def group_sync(b: Budgets, now: float, group: dict[str, float], members: int = 2) -> int:
    """What the sync does, with ``group`` standing in for Redis's script: one total per kind
    (charges applied, grants capped at the limit and a share of what is left). Returns the
    requests slice granted."""
    b.shared = True
    b.members = members
    granted = 0
    for ask in b.asks(now):
        group[ask.kind] = group.get(ask.kind, 0) + sum(amount for _, amount in ask.charges)
        left = ask.limit - int(group[ask.kind])
        grant = max(0, min(ask.want, max(ask.least, left // (2 * members)), left))
        group[ask.kind] += grant
        b.granted(ask, grant, [(0, group[ask.kind])], now)
        if ask.kind == "requests":
            granted = grant
    return granted


def test_shared_mode_spends_leased_slices_and_returns_them_unspent() -> None:
    b = ledger(rpm=1000)
    group: dict[str, float] = {}
    # A new tenant: admitted against its share of the group's budget, charged after the fact.
    admitted(b.charge("evals", 1, 0.0))
    group_sync(b, 0.0, group)
    assert group["requests"] == 1 + 2  # the charge, and a slice of twice the demand
    account = b.accounts()[("evals", "requests")]
    assert account.balance == 2
    for _ in range(5):
        admitted(b.charge("evals", 1, 0.1))
    # Two from the slice, three beyond it: owed to the group (it had plenty left).
    assert account.balance == 0
    assert sum(a for _, a in account.charges) == 3
    group_sync(b, 0.2, group)
    # The slice grows with the demand (twice the 5 asked since the last sync).
    assert group["requests"] == 3 + 3 + 10
    assert account.balance == 10
    group_sync(b, 0.2 + SLICE_SECONDS, group)
    # Nothing spent for a second: the 10 went back; a small slice keeps the tenant going.
    assert group["requests"] == 16 - 10 + 1
    assert account.balance == 1


def test_shared_mode_never_grants_past_the_limit_and_refuses_when_spent() -> None:
    b = ledger(rpm=100)
    group = {"requests": 98.0}  # the other processes took 98
    admitted(b.charge("evals", 1, 0.0))
    assert group_sync(b, 0.0, group) == 1  # asked for 2, one was left
    assert group["requests"] == 100
    admitted(b.charge("evals", 1, 0.01))
    no = refused(b.charge("evals", 1, 0.02))
    assert no.retry_after == 61  # the group's window is full until its bucket leaves it
    assert no.error().headers["x-ratelimit-remaining-requests"] == "0"


def test_a_tenant_new_to_a_process_owes_one_request_until_the_first_sync() -> None:
    b = ledger(rpm=100)
    b.shared, b.members = True, 2  # the group may have spent everything: nothing known yet
    admitted(b.charge("evals", 1, 0.0))
    no = refused(b.charge("evals", 1, 0.0))
    assert no.retry_after == 1


def test_far_from_the_limit_a_burst_is_owed_near_it_only_slices_are_spent() -> None:
    b = ledger(rpm=100)
    group = {"requests": 0.0}
    admitted(b.charge("evals", 1, 0.0))
    group_sync(b, 0.0, group)  # a slice of 2; the window is nearly empty
    for _ in range(2 + 10):  # the slice, then owed: up to 99 / 4 while half is left
        admitted(b.charge("evals", 1, 0.01))
    group["requests"] = 60.0  # the others took most of the rest meanwhile
    group_sync(b, 0.05, group)
    account = b.accounts()[("evals", "requests")]
    spendable = account.balance
    for _ in range(spendable):
        admitted(b.charge("evals", 1, 0.06))
    refused(b.charge("evals", 1, 0.06))  # under half left: nothing owed beyond the slice


def test_a_changed_limit_applies_at_once_and_a_new_window_starts_afresh() -> None:
    b = ledger(rpm=2)
    admitted(b.charge("evals", 1, 0.0))
    admitted(b.charge("evals", 1, 0.0))
    b.policy = BudgetPolicy({"evals": Limits(rpm=3)})
    admitted(b.charge("evals", 1, 0.0))
    refused(b.charge("evals", 1, 0.0))
    b.policy = BudgetPolicy({"evals": Limits(rpm=3)}, window_seconds=6.0)
    admitted(b.charge("evals", 1, 0.0))


def test_alone_nothing_is_kept_for_a_group_and_idle_tenants_are_forgotten() -> None:
    b = Budgets(BudgetPolicy(default=Limits(rpm=5)))
    for i in range(100):
        admitted(b.charge(f"tenant-{i}", 1, 0.0))
    assert all(not a.charges for a in b.accounts().values())
    assert len(b.accounts()) == 100
    admitted(b.charge("late", 1, 100.0))  # a window later: the idle ones are gone
    assert list(b.accounts()) == [("late", "requests")]


def test_duration_reads_like_openais_reset_headers() -> None:
    assert duration(0.25) == "250ms"
    assert duration(1.5) == "1.5s"
    assert duration(360) == "6m0s"
    assert duration(0) == "0ms"


def test_budgets_config_is_parsed_and_every_problem_listed() -> None:
    config = parse_config(
        {
            **MINIMAL,
            "budgets": {
                "tenants": {"evals": {"rpm": 600, "tpm": 200000}},
                "default": {"rpm": 60},
                "window_seconds": 6,
            },
        }
    )
    assert config.budgets.limits("evals") == Limits(600, 200000)
    assert config.budgets.limits("anyone") == Limits(60, 0)
    assert config.budgets.window_seconds == 6.0
    assert config.budgets.window_seconds / BUCKETS == 0.1
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                **MINIMAL,
                "budgets": {
                    "tenants": {"evals": {"rpm": -1, "rps": 3}},
                    "default": {"tpm": 1.5},
                    "window_seconds": 0,
                },
            }
        )
    problems = "\n".join(caught.value.errors)
    for path in (
        "budgets.tenants.evals.rpm",
        "budgets.tenants.evals.rps",
        "budgets.default.tpm",
        "budgets.window_seconds",
    ):
        assert path in problems
    assert not parse_config(MINIMAL).budgets.enabled
