"""lora-affinity-scorer and lora-filter, including vLLM 0.32's real lora_requests_info."""

from __future__ import annotations

from pathlib import Path

from epp.scheduling.filters.lora import LoraFilter
from epp.scheduling.scorers.lora import LoraAffinityScorer
from epp.sources.vllm_metrics import parse_vllm_metrics
from epp.state import EndpointState
from tests.unit.scheduling.common import cycle, ep, req

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm" / "metrics_lora.txt"


def lora_ep(address: str, running: set[str], waiting: set[str], max_loras: int) -> EndpointState:
    return ep(
        address,
        running_loras=frozenset(running),
        waiting_loras=frozenset(waiting),
        max_loras=max_loras,
    )


ENDPOINTS = [
    lora_ep("running", {"x"}, {"x"}, 2),  # vLLM 0.32 lists an active adapter in both labels
    lora_ep("room", {"y"}, {"y"}, 2),  # one adapter active, one slot free
    lora_ep("waiting", {"y"}, {"x", "y"}, 2),  # older vLLM: queued to load, slots full
    lora_ep("full", {"y", "z"}, {"y", "z"}, 2),
    lora_ep("unknown", set(), set(), 0),  # no lora_requests_info before the first request
]


def test_scores_follow_gie() -> None:
    scores = LoraAffinityScorer().score(req("p", lora="x"), ENDPOINTS, cycle())
    assert scores == [1.0, 0.8, 0.6, 0.0, 0.8]


def test_requests_without_adapter_score_one_everywhere() -> None:
    assert LoraAffinityScorer().score(req("p"), ENDPOINTS, cycle()) == [1.0] * 5


def test_real_vllm_metrics_one_active_adapter_leaves_a_slot() -> None:
    """GIE's len(running) + len(waiting) would count tiny-lora twice and see no free slot."""
    page = FIXTURE.read_text()
    # The page's newest series says nothing is in flight (the requests finished); drop it to
    # see the state vLLM published while a tiny-lora request ran.
    idle = 'running_lora_adapters="",waiting_lora_adapters=""'
    busy = "\n".join(line for line in page.splitlines() if idle not in line)
    metrics = parse_vllm_metrics(busy)
    assert metrics.max_loras == 2
    assert metrics.running_loras == metrics.waiting_loras == {"tiny-lora"}
    endpoint = EndpointState("real", "pool", True, metrics, 1.0)
    scorer = LoraAffinityScorer()
    assert scorer.score(req("p", lora="tiny-lora"), [endpoint], cycle()) == [1.0]
    assert scorer.score(req("p", lora="other"), [endpoint], cycle()) == [0.8]
    assert LoraFilter().filter(req("p", lora="other"), [endpoint, ENDPOINTS[3]], cycle()) == [
        endpoint
    ]


def test_filter_keeps_running_or_room() -> None:
    kept = LoraFilter().filter(req("p", lora="x"), ENDPOINTS, cycle())
    assert [e.address for e in kept] == ["running", "room", "unknown"]


def test_filter_keeps_all_when_none_can_load_the_adapter() -> None:
    full = [lora_ep("f1", {"y"}, {"y"}, 1), lora_ep("f2", {"z"}, {"x", "z"}, 1)]
    assert LoraFilter().filter(req("p", lora="x"), full, cycle()) == full


def test_filter_passes_requests_without_adapter() -> None:
    eps = [lora_ep("full", {"y"}, {"y"}, 1), ep("plain")]
    assert LoraFilter().filter(req("p"), eps, cycle()) == eps
