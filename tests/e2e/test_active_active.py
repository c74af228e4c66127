"""Active-active epp end to end: two epp processes behind one Envoy, sharing state through Redis.

Real processes throughout: Envoy, two ``epp serve``, simulated vLLM replicas and a
``redis-server`` of our own on a free port (so a test can stop it), or a local three-master Redis
Cluster. The faults are the ones production sees: an epp SIGKILLed under load, Redis stopped and
restarted under load, a replica crashing under load.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from epp.devstack import Stack, http_ok
from epp.scheduling import plugin_types
from tests.e2e.client import completion, metric_values, request
from tests.e2e.fleet import epp_metric, epp_ready_endpoints, wait_until
from tests.helpers import redis_servers

pytestmark = pytest.mark.skipif(not redis_servers.available(), reason="redis-server not installed")

HAS_PREFIX_SCORER = "prefix-cache-scorer" in plugin_types()
# Prefix affinity outweighs load (5 x ~0.97 against at most 1 + 1), so a group leaves its replica
# only if an epp does not know where the group went: what sharing between epps must prevent.
# Load decides where a group's first request goes, spreading groups over replicas.
PROFILE = {
    "profile": "ha",
    "profiles": {
        "ha": [
            {"plugin": "ready-endpoint-filter"},
            *([{"plugin": "prefix-cache-scorer", "weight": 5}] if HAS_PREFIX_SCORER else []),
            {"plugin": "inflight-load-scorer", "weight": 1},
            {"plugin": "queue-scorer", "weight": 1},
            {"plugin": "max-score-picker"},
        ]
    },
}
# Requests of ~40-100 ms, enough KV for every prefix group (no evictions muddle hit rates).
SIM_ARGS = ["--time-scale", "0.05", "--num-gpu-blocks", "20000"]
# For the stickiness tests: no latency-outlier ejection. A group's first request prefills its
# whole prefix, so the replica that drew the most new groups answers a few times slower for a
# moment, more so on a busy machine, and passive health (docs/health.md) then ejected it and its
# groups moved (seen: stickiness 0.83-0.89, ejections_total{reason="latency"} 1 at one epp).
# Errors still eject.
STEADY_HEALTH = {"latency_factor": 1000.0}
GROUP_PREFIX = "You are assistant {g}. " + "Follow the house style guide carefully. " * 60


def needs_prefix_scorer() -> None:
    if not HAS_PREFIX_SCORER:
        pytest.skip("prefix-cache-scorer is not registered: prefix affinity cannot be tested")


def ha_stack(
    tmp: Path, redis_url: str | None, epps: int = 2, sim_per_replica: bool = False, **extra: object
) -> Stack:
    config: dict[str, object] = {"scheduling": PROFILE, **extra}
    if redis_url is not None:
        config["store"] = {"key_prefix": f"ha-{uuid.uuid4().hex[:8]}"}
    return Stack(
        tmp,
        replicas=3,
        epp_count=epps,
        redis_url=redis_url,
        config_extra=config,
        sim_args=SIM_ARGS,
        sim_per_replica=sim_per_replica,
    )


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[redis_servers.RedisServer]:
    server = redis_servers.RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def picks(stack: Stack, index: int) -> Counter[str]:
    out: Counter[str] = Counter()
    for labels, value in epp_metric(stack, index, "epp_endpoint_picks_total").items():
        out[re.search(r'endpoint="([^"]+)"', labels).group(1)] += int(value)  # type: ignore[union-attr]
    return out


def cache_counters(stack: Stack) -> tuple[float, float]:
    """Prefix-cache (hits, queries) in tokens over all replicas, from their own metrics."""
    hits = queries = 0.0
    for address in stack.replica_addresses:
        url = f"http://{address}/metrics"
        hits += sum(metric_values(url, "vllm:prefix_cache_hits_total").values())
        queries += sum(metric_values(url, "vllm:prefix_cache_queries_total").values())
    return hits, queries


def warm_up(stack: Stack) -> None:
    """Send requests until every epp has routed one.

    Envoy sends streams only to epps whose health checks have passed, and the stack can be
    ready before every epp's first check (with Envoy's default update merge window it took up
    to a second more; the rendered cluster sets it to 0: docs/active-active.md).
    """
    deadline = time.monotonic() + 10
    while min(sum(picks(stack, i).values()) for i in range(stack.epp_count)) == 0:
        assert time.monotonic() < deadline, "Envoy never used every epp"
        assert completion(stack.url, f"warm-up {uuid.uuid4().hex}", 1).status == 200
        time.sleep(0.02)


def picks_applied_everywhere(stack: Stack) -> bool:
    """Whether every pick made so far has reached Redis and every epp has applied the others'.

    A pick is recorded before its answer goes to Envoy, so checked after a reply, true means
    that reply's pick is known to every epp. Reached Redis: nothing pending
    (``epp_shared_picks_pending``); counting shipments alone is not enough, since on a starved
    core the shipper can run after the reply has reached the client. Applied: each epp's
    ``epp_shared_picks_total{direction="applied"}`` covers what the others have ``sent``, read
    after every pending count, so the sent counts include every pick found shipped.
    """
    pending = [epp_metric(stack, i, "epp_shared_picks_pending") for i in range(stack.epp_count)]
    counts = [epp_metric(stack, i, "epp_shared_picks_total") for i in range(stack.epp_count)]
    if any(p.get("", 0.0) for p in pending):
        return False
    sent = [c.get('{direction="sent"}', 0.0) for c in counts]
    return all(
        c.get('{direction="applied"}', 0.0) >= sum(sent) - sent[j] for j, c in enumerate(counts)
    )


def prefix_groups(
    stack: Stack, groups: int = 12, per_group: int = 8
) -> tuple[dict[int, Counter[str]], float]:
    """Each group's requests one after another, groups concurrently.

    With several epps, a group's next request waits until its previous pick has reached the
    other epps: the request could otherwise reach an epp before the pick does (a few ms
    through Redis, longer on a machine whose cores are busy), and what is measured is where
    groups go once the epps share what they learned, not the race with the next request.
    Returns each group's served-replica counts and the replicas' prefix-cache hit rate.
    """
    warm_up(stack)
    hits, queries = cache_counters(stack)
    served: dict[int, Counter[str]] = defaultdict(Counter)
    errors: list[str] = []

    def run(g: int) -> None:
        for i in range(per_group):
            reply = completion(stack.url, GROUP_PREFIX.format(g=g) + f"Question {i}?", 4)
            if reply.status != 200:
                errors.append(f"{reply.status} {reply.body[:200]!r}")
            served[g][reply.served_by or "?"] += 1
            if stack.epp_count > 1:
                try:
                    wait_for(
                        lambda: picks_applied_everywhere(stack),
                        10,
                        "the pick at the other epps",
                    )
                except AssertionError as exc:  # reported by the test's thread, not lost here
                    errors.append(str(exc))
                    return

    threads = [threading.Thread(target=run, args=(g,)) for g in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    ejected = [epp_metric(stack, i, "epp_endpoint_ejections_total") for i in range(stack.epp_count)]
    assert not any(ejected), f"a replica was ejected: groups had to move {ejected}"
    after_hits, after_queries = cache_counters(stack)
    return served, (after_hits - hits) / (after_queries - queries)


def stickiness(served: dict[int, Counter[str]]) -> float:
    """Share of requests that went to their group's most used replica."""
    total = sum(sum(c.values()) for c in served.values())
    return sum(c.most_common(1)[0][1] for c in served.values()) / total


@dataclass
class Outcome:
    started: float
    ended: float
    status: int
    served_by: str | None
    error: str = ""


@dataclass
class Load:
    """Clients sending requests back to back until stopped; every outcome is kept."""

    base: str
    clients: int = 8
    max_tokens: int = 8
    # Prompts of 4 prefix groups, else unique prompts (spread by load over every replica).
    grouped: bool = True
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for c in range(self.clients):
            t = threading.Thread(target=self._run, args=(c,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, client: int) -> None:
        i = 0
        while not self._stop.is_set():
            started = time.monotonic()
            head = GROUP_PREFIX.format(g=client % 4) if self.grouped else ""
            prompt = f"{head}client {client} request {i} {uuid.uuid4().hex}"
            try:
                reply = completion(self.base, prompt, self.max_tokens)
                status, served = reply.status, reply.served_by
                error = "" if status == 200 else reply.body[:300].decode(errors="replace")
            except OSError as exc:  # connection reset mid-response: a failed request too
                status, served, error = 0, None, str(exc)
            self.outcomes.append(Outcome(started, time.monotonic(), status, served, error))
            i += 1

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]


def wait_for(condition: Callable[[], object], within: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def test_prefix_groups_stick_whichever_epp_routes_them(
    tmp_path: Path, own_redis: redis_servers.RedisServer
) -> None:
    needs_prefix_scorer()
    with ha_stack(tmp_path / "one", None, epps=1, health=STEADY_HEALTH) as single:
        single.start()
        _, single_rate = prefix_groups(single)
    with ha_stack(tmp_path / "two", own_redis.url, health=STEADY_HEALTH) as stack:
        stack.start()
        before = [sum(picks(stack, i).values()) for i in range(2)]
        served, pair_rate = prefix_groups(stack)
        by_epp = [sum(picks(stack, i).values()) - before[i] for i in range(2)]
    print(
        f"\nprefix hit rate: one epp {single_rate:.3f}, two epps {pair_rate:.3f}; "
        f"decisions per epp {by_epp}; stickiness {stickiness(served):.3f}"
    )
    assert min(by_epp) > 0, "Envoy should spread streams over both epp processes"
    assert stickiness(served) >= 0.95, dict(served)
    assert pair_rate >= single_rate - 0.05


def test_sigkill_of_one_epp_fails_only_requests_in_flight_on_it(
    tmp_path: Path, own_redis: redis_servers.RedisServer
) -> None:
    with ha_stack(tmp_path, own_redis.url) as stack:
        stack.start()
        warm_up(stack)
        with Load(stack.url) as load:
            time.sleep(1.0)
            in_flight = sum(epp_metric(stack, 1, "epp_in_flight_requests").values())
            killed_at = time.monotonic()
            stack.procs["epp1"].kill()  # SIGKILL, then waits until the process is gone
            dead_at = time.monotonic()
            time.sleep(2.0)
        failures = load.failures()
        print(
            f"\nepp1 SIGKILLed with {in_flight:.0f} streams open; {len(failures)} of "
            f"{len(load.outcomes)} requests failed"
        )
        # Only requests that were under way while epp1 died may fail ...
        assert all(o.started <= dead_at and o.ended >= killed_at for o in failures), (
            killed_at,
            failures,
        )
        assert len(failures) <= load.clients
        # ... and every request that started afterwards succeeded (Envoy retried the stream on
        # the surviving epp or no longer picked the dead one).
        after = [o for o in load.outcomes if o.started > dead_at]
        assert after
        assert all(o.status == 200 for o in after), [o for o in after if o.status != 200]
        # The survivor took over every scrape lease.
        wait_for(lambda: epp_metric(stack, 0, "epp_shared_leases")[""] == 3, 2.0, "leases at epp0")


def test_redis_outage_under_load_fails_nothing_and_state_resyncs(
    tmp_path: Path, own_redis: redis_servers.RedisServer
) -> None:
    with ha_stack(tmp_path, own_redis.url) as stack:
        stack.start()
        warm_up(stack)
        prefix = stack.epp_config()["store"]["key_prefix"]
        with Load(stack.url) as load:

            def served(n: int) -> Callable[[], bool]:
                return lambda: len(load.outcomes) >= n

            wait_for(served(20), 10.0, "20 requests before the outage")
            own_redis.kill()
            wait_for(
                lambda: all(epp_metric(stack, i, "epp_state_store_up")[""] == 0 for i in (0, 1)),
                3.0,
                "epp_state_store_up 0",
            )
            wait_for(served(len(load.outcomes) + 20), 10.0, "20 requests during the outage")
            own_redis.start()  # empty, as after a crash without persistence
            # The state store and the group's sync loop reconnect on their own backoffs (up to
            # 1 s each): the store being up says nothing about membership, leases and loads.
            wait_for(
                lambda: all(epp_metric(stack, i, "epp_state_store_up")[""] == 1 for i in (0, 1)),
                5.0,
                "epp_state_store_up 1",
            )
            wait_for(
                lambda: all(epp_metric(stack, i, "epp_shared_members")[""] == 2 for i in (0, 1)),
                5.0,
                "both epps back in the group",
            )
            wait_for(served(len(load.outcomes) + 20), 10.0, "20 requests after the outage")
        assert load.outcomes
        assert not load.failures(), load.failures()[:5]

        # Every key came back. Membership is a sample of a live protocol: a process whose event
        # loop stalls for a lease TTL (3 intervals, 150 ms) on a busy machine drops out of the
        # member set until its next tick, so the keys are awaited, not read once.
        client = redis.Redis.from_url(own_redis.url)
        missing: list[str] = []

        def resynced() -> bool:
            keys = {k.decode() for k in client.scan_iter(match=f"{{{prefix}}}:*")}
            wanted = [f"{{{prefix}}}:picks"] + [
                f"{{{prefix}}}:{kind}:{address}"
                for address in stack.replica_addresses
                for kind in ("ep", "lease")
            ]
            missing[:] = [k for k in wanted if k not in keys]
            members = client.zcard(f"{{{prefix}}}:members")
            loads = len([k for k in keys if ":load:" in k])
            if members != 2 or loads != 2:
                missing.append(f"members={members} loads={loads}")
            return not missing

        try:
            wait_for(resynced, 3.0, "every key back")
        except AssertionError:
            raise AssertionError(f"not back after the outage: {missing}") from None
        finally:
            client.close()

        # In-flight counts converge: with 6 requests held in flight (engines paused), both
        # processes see the same per-endpoint totals, whichever of them routed what.
        for address in stack.replica_addresses:
            set_fault(address, hang=True)
        held = [
            threading.Thread(target=completion, args=(stack.url, f"held {i}", 4), daemon=True)
            for i in range(6)
        ]
        try:
            for t in held:
                t.start()
            # Each process republishes every sync tick, so the two views may differ for a tick
            # or two; they must agree soon after (a stale or lost publication would not).
            views: list[dict[str, float]] = []

            def agreed() -> bool:
                views[:] = [inflight_view(stack, i) for i in (0, 1)]
                return sum(views[0].values()) == 6 and views[0] == views[1]

            deadline = time.monotonic() + 3.0
            while not agreed() and time.monotonic() < deadline:
                time.sleep(0.02)
            local = [epp_metric(stack, i, "epp_endpoint_inflight_requests") for i in (0, 1)]
        finally:
            for address in stack.replica_addresses:
                set_fault(address, hang=False)
            for t in held:
                t.join(10)
        print(f"\nin-flight per endpoint, as each epp sees it: {views}; raw {local}")
        assert sum(views[0].values()) == 6
        assert views[0] == views[1]

        for i in (0, 1):
            log = (tmp_path / f"epp{i}.log").read_text()
            assert log.count("shared state unavailable") == 1, "said once per process"
            assert log.count("is unreachable") == 1


def set_fault(address: str, **faults: object) -> None:
    assert request(f"http://{address}", "/admin/faults", dict(faults)).status == 200


def inflight_view(stack: Stack, index: int) -> dict[str, float]:
    """Endpoint -> local + remote in-flight requests, as epp ``index`` saw at its last sync."""
    view: dict[str, float] = defaultdict(float)
    for labels, value in epp_metric(stack, index, "epp_endpoint_inflight_requests").items():
        view[re.search(r'endpoint="([^"]+)"', labels).group(1)] += value  # type: ignore[union-attr]
    return dict(view)


class CrashWatcher:
    """Probes one replica and both epps' pick counters for it every few ms.

    ``died`` is when the replica first failed to answer ``/health``; ``last_pick[i]`` the
    earliest time epp ``i``'s last pick of it can have happened: when the read before the one
    that saw its counter grow began. Stamping the read that saw the growth instead charged the
    watcher's own lag to epp: on a busy machine a read of ``/metrics`` takes 100 ms or more,
    and a pick made just before the crash was counted as made that much after it.
    """

    def __init__(self, stack: Stack, address: str) -> None:
        self.stack, self.address = stack, address
        self.died = 0.0
        self.last_pick = [0.0, 0.0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CrashWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        seen = [-1, -1]
        read_at = [0.0, 0.0]  # when the latest read of each epp's counter began
        while not self._stop.is_set():
            if not self.died and not http_ok(f"http://{self.address}/health", timeout=0.05):
                self.died = time.monotonic()
            for i in (0, 1):
                started = time.monotonic()
                count = picks(self.stack, i)[self.address]
                if count != seen[i]:
                    seen[i], self.last_pick[i] = count, read_at[i]
                read_at[i] = started
            time.sleep(0.003)


def test_crashed_replica_loses_its_traffic_once_unready_and_nothing_fails(
    tmp_path: Path, own_redis: redis_servers.RedisServer
) -> None:
    # One failed scrape is enough here: a crashed replica refuses connections outright. Each
    # replica in its own process, so the crash fault ends it as a real crash would.
    with ha_stack(
        tmp_path, own_redis.url, sim_per_replica=True, scrape={"failure_threshold": 1}
    ) as stack:
        stack.start()
        warm_up(stack)
        dead = stack.replica_addresses[1]
        with Load(stack.url, grouped=False) as load, CrashWatcher(stack, dead) as watcher:
            time.sleep(0.8)
            set_fault(dead, crash=True)
            wait_until_refused(dead)
            wait_until(
                lambda: all(dead not in epp_ready_endpoints(stack, i) for i in (0, 1)),
                10,
                "both epps to mark the crashed replica unready",
            )
            after = [picks(stack, i)[dead] for i in (0, 1)]
            # Something that must not happen: a window a busy machine shortens, never fails.
            time.sleep(1.0)
            assert [picks(stack, i)[dead] for i in (0, 1)] == after, "picked once unready"
        # How soon traffic left it is a wall-clock figure a busy machine stretches: printed.
        # Negative: that epp had already stopped picking it (load had moved elsewhere).
        delays = [round(t - watcher.died, 3) for t in watcher.last_pick]
        print(f"\nlast pick of the crashed replica after it stopped answering: {delays} s")
        # With a fallback in every answer Envoy retries on the next replica: nothing fails.
        assert load.outcomes
        assert not load.failures(), load.failures()[:5]


def wait_until_refused(address: str) -> None:
    host, port = address.split(":")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
        except OSError:
            return
        time.sleep(0.005)
    raise AssertionError(f"{address} still accepts connections")


def test_two_epps_on_a_redis_cluster(tmp_path: Path) -> None:
    needs_prefix_scorer()
    cluster = redis_servers.ClusterSetup(tmp_path / "cluster").start()
    try:
        with ha_stack(tmp_path / "stack", cluster.url, health=STEADY_HEALTH) as stack:
            stack.start()
            served, _ = prefix_groups(stack)
            leases = [epp_metric(stack, i, "epp_shared_leases")[""] for i in (0, 1)]
            members = [epp_metric(stack, i, "epp_shared_members")[""] for i in (0, 1)]
            by_epp = [sum(picks(stack, i).values()) for i in range(2)]
        assert sorted(leases) == [1, 2]
        assert members == [2, 2]
        assert min(by_epp) > 0
        assert stickiness(served) >= 0.95, dict(served)
    finally:
        cluster.stop()
