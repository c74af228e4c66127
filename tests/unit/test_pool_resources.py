"""InferenceModelRewrite and InferenceObjective resources followed with the pool against a local
server speaking the API's list/watch protocol (tests/helpers/fake_kube.py): both API groups,
each change published within one watch event, a group whose CRD is not installed is empty."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from epp.discovery.policy import ClusterPolicy
from epp.discovery.pool_resources import ClusterResources
from epp.discovery.spec import KubernetesSpec
from tests.helpers.fake_kube import (
    OLD_GROUP,
    FakeKube,
    inference_objective,
    model_rewrite,
    objectives_kind,
    rewrites_kind,
    split,
)

WITHIN = 2.0


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    # The older group's objectives are not installed here: that kind answers 404.
    with FakeKube(absent=frozenset({objectives_kind(OLD_GROUP)})) as server:
        server.put(
            rewrites_kind(),
            model_rewrite("canary", "vllm-pool", [split("chat", ("chat-v1", 90), ("chat-v2", 10))]),
        )
        server.put(objectives_kind(), inference_objective("critical", "vllm-pool", 10))
        server.put(objectives_kind(), inference_objective("elsewhere", "other-pool", 5))
        yield server


class Seen:
    def __init__(self, resources: ClusterResources) -> None:
        self.resources = resources
        self.changes = 0
        self._event = asyncio.Event()

    def __call__(self) -> None:
        self.changes += 1
        self._event.set()

    async def until(self, check: Callable[[ClusterPolicy], bool]) -> ClusterPolicy:
        async with asyncio.timeout(WITHIN):
            while not check(self.resources.current()):
                self._event.clear()
                await self._event.wait()
        return self.resources.current()


@pytest.fixture
async def seen(kube: FakeKube) -> AsyncIterator[Seen]:
    holder: list[Seen] = []
    resources = ClusterResources(lambda: holder[0]())
    holder.append(Seen(resources))
    resources.configure({"main": KubernetesSpec("vllm-pool", api_url=kube.url)})
    yield holder[0]
    await resources.stop()


def weights(policy: ClusterPolicy) -> list[tuple[str, int]]:
    return [(t.model, t.weight) for r in policy.rewrites for t in r.targets]


async def test_rewrites_and_objectives_of_the_pool_are_followed(kube: FakeKube, seen: Seen) -> None:
    policy = await seen.until(lambda p: bool(p.rewrites) and bool(p.objectives))
    assert weights(policy) == [("chat-v1", 90), ("chat-v2", 10)]
    assert policy.rewrites[0].origin == "InferenceModelRewrite default/canary rules[0]"
    assert policy.objectives == {"critical": 10}

    # New weights: one watch event later, the new split.
    kube.put(
        rewrites_kind(),
        model_rewrite("canary", "vllm-pool", [split("chat", ("chat-v1", 0 + 1), ("chat-v2", 99))]),
    )
    policy = await seen.until(lambda p: weights(p) == [("chat-v1", 1), ("chat-v2", 99)])

    # The older group is read too; the resource is newer, so its exact rule comes second.
    kube.put(
        rewrites_kind(OLD_GROUP),
        model_rewrite("legacy", "vllm-pool", [split("other", ("chat-v1", 1))], group=OLD_GROUP),
    )
    policy = await seen.until(lambda p: len(p.rewrites) == 2)
    assert policy.rewrites[1].origin == "InferenceModelRewrite default/legacy rules[0]"

    # Objectives change and go.
    kube.put(objectives_kind(), inference_objective("critical", "vllm-pool", -3))
    await seen.until(lambda p: p.objectives == {"critical": -3})
    kube.delete(objectives_kind(), "critical")
    await seen.until(lambda p: p.objectives == {})
    kube.delete(rewrites_kind(), "canary")
    kube.delete(rewrites_kind(OLD_GROUP), "legacy")
    await seen.until(lambda p: p.rewrites == ())


async def test_a_reload_that_drops_the_pool_drops_its_resources(seen: Seen) -> None:
    await seen.until(lambda p: bool(p.rewrites))
    seen.resources.configure({})
    assert seen.resources.current() == ClusterPolicy()
