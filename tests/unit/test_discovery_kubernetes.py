"""Kubernetes discovery against a local server speaking the API's list/watch protocol
(tests/helpers/fake_kube.py): each change to the pods or the InferencePool reaches the
published endpoint set, across closed streams, 410 Gone both ways, and errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping

import pytest

from epp.discovery.kubernetes import KubernetesSource
from epp.discovery.spec import KubernetesSpec
from epp.roles import ROLE_LABEL, Role
from tests.helpers.fake_kube import FakeKube, inference_pool, pod

# How long a change may take to be published before the test fails: a bound on a hang, not
# the property tested (a busy machine can take more than a second over one watch event).
WITHIN = 5.0
APP = {"app": "vllm"}


class Recorder:
    def __init__(self) -> None:
        self.sets: list[frozenset[str]] = []
        self.roles: Mapping[str, Role] = {}
        self._changed = asyncio.Event()

    def __call__(self, members: frozenset[str], roles: Mapping[str, Role] | None = None) -> None:
        self.sets.append(members)
        self.roles = dict(roles or {})
        self._changed.set()

    async def wait_for(self, expected: set[str], within: float = WITHIN) -> float:
        started = time.monotonic()
        try:
            async with asyncio.timeout(within):
                while not self.sets or self.sets[-1] != expected:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            last = sorted(self.sets[-1]) if self.sets else None
            pytest.fail(f"not {sorted(expected)} within {within}s; last published {last}")
        return time.monotonic() - started


@pytest.fixture(params=["status", "event"])
def kube(request: pytest.FixtureRequest) -> Iterator[FakeKube]:
    with FakeKube(gone_as=request.param) as server:
        server.put("inferencepools", inference_pool("vllm-pool", APP, [8000]))
        server.put("pods", pod("a", "10.0.0.1", APP))
        server.put("pods", pod("b", "10.0.0.2", APP, ready=False))
        server.put("pods", pod("other", "10.0.0.9", {"app": "other"}))
        yield server


@pytest.fixture
async def seen(kube: FakeKube) -> AsyncIterator[Recorder]:
    recorder = Recorder()
    source = KubernetesSource(KubernetesSpec("vllm-pool", "default", api_url=kube.url))
    task = asyncio.create_task(source.run(recorder))
    await recorder.wait_for({"10.0.0.1:8000"})
    yield recorder
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _watches(kube: FakeKube, kind: str) -> list[dict[str, str]]:
    return [q for path, q in kube.requests if path.endswith(kind) and q.get("watch") == "true"]


async def test_pods_added_made_unready_and_deleted(kube: FakeKube, seen: Recorder) -> None:
    kube.put("pods", pod("c", "10.0.0.3", APP))
    await seen.wait_for({"10.0.0.1:8000", "10.0.0.3:8000"})
    kube.put("pods", pod("b", "10.0.0.2", APP))  # became Ready
    await seen.wait_for({"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"})
    kube.put("pods", pod("a", "10.0.0.1", APP, ready=False))
    await seen.wait_for({"10.0.0.2:8000", "10.0.0.3:8000"})
    kube.put("pods", pod("c", "10.0.0.3", APP, deleting=True))  # terminating: out at once
    await seen.wait_for({"10.0.0.2:8000"})
    kube.delete("pods", "b")
    await seen.wait_for(set())
    # Every watch asked for bookmarks and started from a list's resourceVersion.
    watches = _watches(kube, "pods")
    assert watches
    assert all(q["allowWatchBookmarks"] == "true" and q["resourceVersion"] for q in watches)


async def test_role_label_is_published_with_the_endpoints(kube: FakeKube, seen: Recorder) -> None:
    await seen.wait_for({"10.0.0.1:8000"})
    kube.put("pods", pod("p", "10.0.0.4", {**APP, ROLE_LABEL: "prefill"}))
    kube.put("pods", pod("d", "10.0.0.5", {**APP, ROLE_LABEL: "decode"}))
    kube.put("pods", pod("both", "10.0.0.6", {**APP, ROLE_LABEL: "prefill-decode"}))
    kube.put("pods", pod("odd", "10.0.0.7", {**APP, ROLE_LABEL: "sideways"}))
    await seen.wait_for({f"10.0.0.{i}:8000" for i in (1, 4, 5, 6, 7)})
    # No label or an unknown value: no role (both), as llm-d's decode filter accepts them.
    assert seen.roles == {
        "10.0.0.4:8000": "prefill",
        "10.0.0.5:8000": "decode",
        "10.0.0.6:8000": "both",
    }


async def test_closed_watch_resumes_from_last_version(kube: FakeKube, seen: Recorder) -> None:
    kube.bookmark()  # moves the client's version past its list's
    kube.put("pods", pod("c", "10.0.0.3", APP))
    await seen.wait_for({"10.0.0.1:8000", "10.0.0.3:8000"})
    lists_before = sum(1 for p, q in kube.requests if p.endswith("pods") and "watch" not in q)
    kube.partition()
    kube.put("pods", pod("d", "10.0.0.4", APP))  # while no stream is open
    kube.heal()
    await seen.wait_for({"10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000"})
    resumed = _watches(kube, "pods")[-1]
    # Resumed (no relist) from the version of the last event it had seen.
    assert int(resumed["resourceVersion"]) > int(_watches(kube, "pods")[0]["resourceVersion"])
    lists_after = sum(1 for p, q in kube.requests if p.endswith("pods") and "watch" not in q)
    assert lists_after == lists_before


async def test_gone_relists_and_drops_what_was_missed(kube: FakeKube, seen: Recorder) -> None:
    lists = len([p for p, q in kube.requests if p.endswith("pods") and "watch" not in q])
    kube.partition()
    # Changes the client cannot replay: history is compacted before it resumes, and its
    # resumed watch gets 410 (as the HTTP status or as an ERROR event, per fixture).
    kube.delete("pods", "a")
    kube.put("pods", pod("e", "10.0.0.5", APP))
    kube.compact()
    kube.heal()
    await seen.wait_for({"10.0.0.5:8000"})
    relists = len([p for p, q in kube.requests if p.endswith("pods") and "watch" not in q])
    assert relists > lists


async def test_gone_inside_an_open_stream(kube: FakeKube, seen: Recorder) -> None:
    kube.compact()
    kube.expire_watches()  # ERROR 410 event in every open stream (pods and pool)
    kube.put("pods", pod("f", "10.0.0.6", APP))
    await seen.wait_for({"10.0.0.1:8000", "10.0.0.6:8000"})


async def test_pool_selector_and_ports_change(kube: FakeKube, seen: Recorder) -> None:
    kube.put("inferencepools", inference_pool("vllm-pool", {"app": "other"}, [8000]))
    await seen.wait_for({"10.0.0.9:8000"})
    kube.put("inferencepools", inference_pool("vllm-pool", {"app": "other"}, [8000, 8001]))
    await seen.wait_for({"10.0.0.9:8000", "10.0.0.9:8001"})
    kube.delete("inferencepools", "vllm-pool")  # no pool, no endpoints
    await seen.wait_for(set())
    kube.put("inferencepools", inference_pool("vllm-pool", APP, [8000]))
    await seen.wait_for({"10.0.0.1:8000"})


async def test_errors_back_off_and_recover(kube: FakeKube, seen: Recorder) -> None:
    kube.fail_next("pods", 3)  # the resumed watch, then two relists, fail
    kube.close_watches()
    kube.put("pods", pod("g", "10.0.0.7", APP))
    # Back-off 0.1 + 0.2 + 0.4 s (+-20%) before the fourth attempt succeeds.
    took = await seen.wait_for({"10.0.0.1:8000", "10.0.0.7:8000"})
    assert took >= 0.5


async def test_unreachable_api_server_publishes_nothing_and_keeps_trying() -> None:
    with FakeKube() as kube:
        url = kube.url
    recorder = Recorder()
    task = asyncio.create_task(
        KubernetesSource(KubernetesSpec("vllm-pool", api_url=url)).run(recorder)
    )
    await asyncio.sleep(0.5)
    assert not task.done()
    assert recorder.sets == []
    task.cancel()
