"""Tenant budgets end to end: a real Envoy in front of two epp processes sharing the real Redis,
one tenant's requests reaching both. Together they admit the tenant's limit and no more; every
429 carries Retry-After, the drop reason and the x-ratelimit-* headers; admitted responses carry
the headers too (buffered and full-duplex). With Redis down, each epp admits at most its share
(limit / 2) and says so."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epp.devstack import Stack
from tests.e2e.client import Reply, completion
from tests.e2e.conftest import REDIS_URL
from tests.e2e.fleet import epp_metric, wait_until
from tests.helpers import redis_servers

RPM = 40
TPM = 100_000  # generous: requests run out first, the token headers still show
WINDOW = 30  # seconds: the whole run falls in one window even on a slow machine
EVALS_KEY = "sk-test-evals"
CHAT_KEY = "sk-test-chat"
OFFERED = 2 * RPM
PACE = 0.1  # seconds between requests: twice the limit offered over 8 s, as a steady stream


def budget_stack(
    tmp: Path, mode: str, redis_url: str = REDIS_URL, scrape: dict[str, float] | None = None
) -> Stack:
    return Stack(
        tmp,
        replicas=2,
        mode=mode,  # type: ignore[arg-type]
        epp_count=2,
        redis_url=redis_url,
        sim_args=["--time-scale", "0.02"],
        config_extra={
            "store": {"key_prefix": f"budget-{uuid.uuid4().hex[:8]}"},
            "scrape": scrape or {},
            "budgets": {
                "tenants": {"evals": {"rpm": RPM, "tpm": TPM}},
                "window_seconds": WINDOW,
            },
            # Tenants come from their API keys (a fairness header from a client is stripped).
            "request": {"api_keys": {EVALS_KEY: {"tenant": "evals"}, CHAT_KEY: {"tenant": "chat"}}},
        },
    )


def both_epps_used(stack: Stack) -> None:
    """Unbudgeted requests until Envoy has sent one to each epp."""
    deadline = time.monotonic() + 30
    while True:
        picks = [sum(epp_metric(stack, i, "epp_endpoint_picks_total").values()) for i in range(2)]
        if min(picks) > 0:
            return
        assert time.monotonic() < deadline, f"Envoy never used both epps: {picks}"
        assert completion(stack.url, "warm-up", 1).status == 200


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
def test_two_epps_admit_one_tenants_limit_and_429_with_the_headers(
    tmp_path: Path, mode: str
) -> None:
    with budget_stack(tmp_path, mode) as stack:
        stack.start()
        both_epps_used(stack)
        # Another tenant has no budget: no headers, never refused.
        other = completion(stack.url, "other tenant", 1, authorization=f"Bearer {CHAT_KEY}")
        assert other.status == 200
        assert "x-ratelimit-limit-requests" not in other.headers

        started = time.monotonic()

        def send(i: int) -> Reply:
            time.sleep(max(0.0, started + i * PACE - time.monotonic()))
            return completion(stack.url, f"eval {i}", 2, authorization=f"Bearer {EVALS_KEY}")

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(send, range(OFFERED)))
        assert time.monotonic() - started < WINDOW, "the run outlasted the window"

        ok = [r for r in replies if r.status == 200]
        refused = [r for r in replies if r.status == 429]
        assert len(ok) + len(refused) == OFFERED, sorted({r.status for r in replies})
        # The group admits the limit: never more than 5% over, little stranded in leases.
        remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in refused)
        assert 0.9 * RPM <= len(ok) <= 1.05 * RPM, (len(ok), remaining)
        for reply in ok:
            assert reply.headers["x-ratelimit-limit-requests"] == str(RPM)
            assert reply.headers["x-ratelimit-limit-tokens"] == str(TPM)
            assert int(reply.headers["x-ratelimit-remaining-requests"]) < RPM
            assert reply.headers["x-ratelimit-reset-requests"].endswith("s")
        for reply in refused:
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.headers["x-epp-request-dropped-reason"] == "rejected-budget"
            assert reply.headers["x-ratelimit-limit-requests"] == str(RPM)
            # What the group had left as this epp last saw it: usually 0; a little when the
            # refusing epp's slice ran out while the others' unspent slices were still out.
            assert int(reply.headers["x-ratelimit-remaining-requests"]) <= 0.5 * RPM
            assert "x-ratelimit-reset-tokens" in reply.headers
            error = reply.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert error["code"] == "rate_limit_exceeded"
            assert error["param"] == "requests"
        # Both epps spent from the one budget.
        admitted = [
            epp_metric(stack, i, "epp_budget_admitted_total").get('{tenant="evals"}', 0.0)
            for i in range(2)
        ]
        assert min(admitted) > 0, admitted
        assert sum(admitted) == len(ok)


def tenant_metric(stack: Stack, index: int, name: str) -> float:
    return sum(v for k, v in epp_metric(stack, index, name).items() if 'tenant="evals"' in k)


@pytest.mark.skipif(not redis_servers.available(), reason="redis-server not installed")
def test_with_redis_down_each_epp_admits_at_most_its_share(tmp_path: Path) -> None:
    redis = redis_servers.RedisServer(tmp_path / "redis").start()
    try:
        # The group's members live three sync intervals (the scrape interval). At the default
        # 50 ms a busy machine's late tick alone drops one, and the other would then count a
        # group of one when Redis dies and admit the whole limit; at 0.5 s it cannot.
        with budget_stack(
            tmp_path / "stack", "buffered", redis.url, scrape={"interval": 0.5}
        ) as stack:
            stack.start()
            both_epps_used(stack)
            # The count local mode will divide the limit by, as each epp's budget sync saw it.
            wait_until(
                lambda: all(
                    epp_metric(stack, i, "epp_budget_members").get("") == 2 for i in range(2)
                ),
                30,
                "both epps' budget syncs count the group of two",
            )
            redis.kill()
            wait_until(
                lambda: all(
                    epp_metric(stack, i, "epp_budget_local_mode").get("") == 1 for i in range(2)
                ),
                30,
                "both epps in local mode",
            )
            replies = [
                completion(stack.url, f"eval {i}", 2, authorization=f"Bearer {EVALS_KEY}")
                for i in range(OFFERED)
            ]
            share = RPM // 2
            admitted = [tenant_metric(stack, i, "epp_budget_admitted_total") for i in range(2)]
            refused = [tenant_metric(stack, i, "epp_budget_refused_total") for i in range(2)]
            # Each epp admitted what it received up to its share (limit / 2), never more; and
            # twice the limit offered reaches the share somewhere.
            for a, r in zip(admitted, refused, strict=True):
                assert a == min(share, a + r), (admitted, refused)
            assert sum(refused) > 0, (admitted, refused)
            assert sum(r.status == 200 for r in replies) == sum(admitted)
            for reply in replies:
                if reply.status == 429:
                    assert reply.headers["x-epp-request-dropped-reason"] == "rejected-budget"
                    assert int(reply.headers["retry-after"]) >= 1
                    assert reply.headers["x-ratelimit-limit-requests"] == str(RPM)
    finally:
        redis.stop()
