"""The stream state machine hands each finished response to the registered response hooks,
without gRPC: a recording hook sees what the response showed, a failing hook costs only
itself, and a stream that closes before its response ends still reports it, once."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from epp.lifecycle import Finished, Lifecycle, Usage
from tests.unit.test_engine_cached import Exchange, usage_chunk
from tests.unit.test_stream import make_router


@dataclass
class Recorder:
    name: str = "recorder"
    seen: list[Finished] = field(default_factory=list)

    def finished(self, done: Finished) -> None:
        self.seen.append(done)


class Broken:
    name = "broken"

    def finished(self, done: Finished) -> None:
        raise RuntimeError("hook bug")


async def test_a_finished_response_reaches_every_hook_once_with_what_it_showed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = await make_router()
    before, after = Recorder("before"), Recorder("after")
    router.lifecycle = Lifecycle([before, Broken(), after])
    exchange = Exchange(router)
    exchange.first_token(0.25)
    exchange.end(usage_chunk(prompt=812, cached=512))
    # The stream closes after the response completed: nothing is reported twice.
    exchange.handler.close()
    assert len(before.seen) == len(after.seen) == 1
    done = after.seen[0]
    assert done is before.seen[0]
    assert done.request.model == "tiny"
    assert done.outcome.complete
    assert done.outcome.status == 200
    assert done.outcome.served == exchange.endpoint
    assert done.outcome.ttft == pytest.approx(0.25)
    assert done.outcome.usage == Usage(812, 2, 512)
    assert done.pick is not None
    assert done.pick.endpoint == exchange.endpoint
    assert not done.spilled
    assert done.charge is None
    assert "response hook broken failed" in caplog.text


async def test_a_stream_closed_mid_response_is_reported_incomplete() -> None:
    router = await make_router()
    recorder = Recorder()
    router.lifecycle = Lifecycle([recorder])
    exchange = Exchange(router)
    exchange.first_token()
    exchange.handler.close()
    (done,) = recorder.seen
    assert not done.outcome.complete
    assert done.outcome.usage is None


async def test_the_standard_hooks_run_in_order() -> None:
    router = await make_router()
    names = [hook.name for hook in router.lifecycle.hooks]
    assert names == [
        "metrics",
        "budget-correction",
        "service-rate",
        "latency-learning",
        "passive-health",
    ]
    recorder = Recorder()
    router.lifecycle.register(recorder)
    assert router.lifecycle.hooks[-1] is recorder
