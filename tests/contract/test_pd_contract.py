"""Prefill/decode disaggregation against two real vLLM engines on CPU (EPP_CONTRACT=1 only).

The fleet, as docs/pd.md deploys it: vLLM P (role prefill) and vLLM D (the decode engine),
both with vLLM's ``ExampleConnector`` over one shared directory (the prefill writes the
prompt's KV there as safetensors files, keyed by the prompt's whole blocks; the decode engine
finds and loads them); ``epp pd-sidecar`` S in front of D (role decode, connector
``shared-storage``); epp and a real Envoy in front of P and S.

What it proves, observed on the engines themselves:

- a long uncached prompt through Envoy is disaggregated by epp, prefilled on P (one more
  request there) and decoded on D, which loads the prompt's whole blocks from the connector
  (``vllm:external_prefix_cache_hits`` and ``vllm:prompt_tokens_by_source{source=
  "external_kv_transfer"}`` rise by them, ``local_compute`` only by the rest, D logs
  ``External Cache Hit!``), and the tokens and their logprobs equal aggregated serving on D
  at temperature 0;
- streamed, the same split answers with intact SSE events, the aggregated text and usage;
- a short prompt stays on D (decode-only), P is not called;
- with P stopped, a request still succeeds with the aggregated answer: through Envoy, and
  directly at the sidecar with the prefill header naming P, where the failed prefill leg
  leaves D to prefill the whole prompt itself.

Between checks the shared directory is emptied and D's prefix cache reset (vLLM's dev-mode
route), so every transfer is from a prompt the engines have not seen.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import skip_reason
from engine_stack import EngineStack, counter, engine_stack
from vllm_server import VllmServer, start_vllms

from epp.devstack import free_port
from tests.e2e.client import request
from tests.helpers.pd_profiles import PROFILES

pytestmark = pytest.mark.contract

LONG, SHORT = 100, 20  # prompt tokens: above and below the threshold
DECISIONS = "llm_d_inference_scheduler_disagg_decision_total"


@dataclass
class PdFleet:
    stack: EngineStack
    prefill: VllmServer  # P
    decode: VllmServer  # D, behind the sidecar
    sidecar: str  # S, the decode endpoint of epp's pool
    storage: Path  # the connector's shared directory

    @property
    def epp_metrics(self) -> str:
        return f"http://127.0.0.1:{self.stack.epp_ports[0][2]}"

    def fresh(self) -> None:
        """No KV anywhere: the shared directory emptied, D's prefix cache reset."""
        shutil.rmtree(self.storage)
        self.storage.mkdir()
        reset = request(self.decode.base_url, "/reset_prefix_cache", method="POST")
        assert reset.status == 200, reset.body[:200]

    def counts(self) -> dict[str, float]:
        d = self.decode.base_url
        counts = {
            "decode_external_hits": counter(d, "vllm:external_prefix_cache_hits_total"),
            "decode_transferred": counter(
                d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
            ),
            "decode_computed": counter(
                d, "vllm:prompt_tokens_by_source_total", source="local_compute"
            ),
            "split": counter(self.epp_metrics, DECISIONS, decision_type="prefill-decode"),
            "local": counter(self.epp_metrics, DECISIONS, decision_type="decode-only"),
        }
        if self.prefill.proc.poll() is None:
            counts["prefill_requests"] = counter(
                self.prefill.base_url, "vllm:request_success_total"
            )
        return counts


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdFleet]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("pd-contract")
    storage = tmp / "kv"
    storage.mkdir()
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    engine = {"dev_mode": True, "extra_args": ["--kv-transfer-config", json.dumps(connector)]}
    with start_vllms(engine, engine, engine_nice=19) as (prefill, decode):
        p = f"127.0.0.1:{prefill.port}"
        sidecar = f"127.0.0.1:{free_port()}"
        endpoints = [{"address": p, "role": "prefill"}, {"address": sidecar, "role": "decode"}]
        stack = engine_stack(
            tmp, [p, sidecar], {"pools": {"main": {"endpoints": endpoints}}, "scheduling": PROFILES}
        )
        # fmt: off
        stack.spawn("sidecar", [
            sys.executable, "-m", "epp", "pd-sidecar", "--listen", sidecar,
            "--engine", decode.base_url, "--connector", "shared-storage", "--prefill", p,
            "--prefill-timeout", "30",
        ])
        # fmt: on
        with stack:
            stack.start()
            yield PdFleet(stack, prefill, decode, sidecar, storage)


def prompt(tokens: int) -> list[int]:
    """Token ids drawn at random: no earlier prompt of the run starts with them."""
    return random.sample(range(5, 3000), tokens)


def complete(base: str, ids: list[int], headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    reply = request(base, "/v1/completions", body, headers, timeout=120)
    assert reply.status == 200, reply.body[:300]
    answer: dict[str, Any] = reply.json()
    return answer


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same tokens, and logprobs equal to float32 rounding: the KV the decode engine
    attended to is the prompt's, not garbage that happens to pick the same argmax."""
    g, w = got["choices"][0], want["choices"][0]
    assert g["text"] == w["text"]
    assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert g["logprobs"]["token_logprobs"] == pytest.approx(
        w["logprobs"]["token_logprobs"], abs=1e-3
    )


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def test_long_prompt_prefilled_on_p_decoded_on_d_as_aggregated(pd: PdFleet) -> None:
    ids = prompt(LONG)
    aggregated = complete(pd.decode.base_url, ids)
    pd.fresh()
    hits_logged = pd.decode.log_path.read_text(errors="replace").count("External Cache Hit!")
    before = pd.counts()
    answer = complete(pd.stack.url, ids)
    delta = grew(before, pd.counts())
    # The connector keys the prompt minus its last token, cut to whole blocks.
    moved = (LONG - 2) // pd.decode.block_size * pd.decode.block_size
    assert delta == {
        "decode_external_hits": moved,
        "decode_transferred": moved,
        "decode_computed": LONG - moved,
        "split": 1,
        "local": 0,
        "prefill_requests": 1,
    }
    logged = pd.decode.log_path.read_text(errors="replace").count("External Cache Hit!")
    assert logged == hits_logged + 1
    same_answer(answer, aggregated)


def test_streamed_disaggregated_answer_is_intact(pd: PdFleet) -> None:
    ids = prompt(LONG)
    aggregated = complete(pd.decode.base_url, ids)["choices"][0]["text"]
    pd.fresh()
    before = pd.counts()
    body = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = request(pd.stack.url, "/v1/completions", body, timeout=120)
    assert reply.status == 200, reply.body[:300]
    assert reply.headers["content-type"].startswith("text/event-stream")
    text = reply.body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n")[:-2]]
    assert "".join(c["text"] for e in events for c in e["choices"]) == aggregated
    assert events[-1]["usage"]["completion_tokens"] == 8
    delta = grew(before, pd.counts())
    assert (delta["split"], delta["prefill_requests"]) == (1, 1)
    assert delta["decode_external_hits"] > 0


def test_short_prompt_stays_on_the_decode_replica(pd: PdFleet) -> None:
    before = pd.counts()
    complete(pd.stack.url, prompt(SHORT))
    delta = grew(before, pd.counts())
    assert (delta["local"], delta["split"], delta["prefill_requests"]) == (1, 0, 0)
    assert (delta["decode_external_hits"], delta["decode_computed"]) == (0, SHORT)


def test_a_stopped_prefill_replica_falls_back_to_local_prefill(pd: PdFleet) -> None:
    ids = prompt(LONG)
    aggregated = complete(pd.decode.base_url, ids)
    pd.prefill.stop()
    # Through Envoy: whether epp still names P (its scrape has not failed yet) or not.
    pd.fresh()
    same_answer(complete(pd.stack.url, ids), aggregated)
    # At the sidecar, with the header naming P as epp would: the leg fails, D prefills it all.
    pd.fresh()
    before = pd.counts()
    p = f"127.0.0.1:{pd.prefill.port}"
    answer = complete(f"http://{pd.sidecar}", ids, {"x-prefiller-host-port": p})
    delta = grew(before, pd.counts())
    assert (delta["decode_computed"], delta["decode_external_hits"]) == (LONG, 0)
    same_answer(answer, aggregated)
    log = pd.stack.procs["sidecar"].log
    assert log is not None
    assert f"prefill leg on {p} failed" in log.read_text()
