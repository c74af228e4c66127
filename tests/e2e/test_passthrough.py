"""Pass-through paths through the real Envoy, both body modes: vLLM's own non-inference APIs
named in ``routing.passthrough`` reach a ready replica of the pool (routed at the headers, the
body unread); paths not named stay a 404 JSON from epp and never reach a replica."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epp.devstack import Stack
from tests.e2e.client import request
from tests.e2e.conftest import BODY_MODES, serve_stack


@pytest.fixture(scope="module", params=BODY_MODES)
def passing(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from serve_stack(
        tmp_path_factory,
        "passthrough",
        request.param,
        replicas=2,
        config_extra={"routing": {"passthrough": {"/tokenize": "main", "/version": "main"}}},
    )


def test_a_post_with_a_body_reaches_a_replica_unchanged(passing: Stack) -> None:
    reply = request(passing.url, "/tokenize", {"model": "tiny", "prompt": "hello world"})
    assert reply.status == 200, reply.body[:300]
    assert reply.served_by in passing.replica_addresses
    tokens = reply.json()["tokens"]
    assert isinstance(tokens, list)
    assert tokens
    # The replica tokenized exactly what the client sent: the body went through intact.
    again = request(passing.url, "/tokenize", {"model": "tiny", "prompt": "hello world"})
    assert again.json()["tokens"] == tokens


def test_idle_replicas_share_bodiless_gets(passing: Stack) -> None:
    served = {request(passing.url, "/version").served_by for _ in range(6)}
    assert served == set(passing.replica_addresses)


def test_unlisted_paths_stay_404_json_from_epp(passing: Stack) -> None:
    reply = request(passing.url, "/detokenize", {"model": "tiny", "tokens": [1, 2]})
    assert reply.status == 404
    assert reply.json()["error"]["code"] == "unknown_url"
    assert reply.served_by is None
