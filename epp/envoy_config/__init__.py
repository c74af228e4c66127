"""Render the Envoy 1.40 bootstrap that fronts a vLLM fleet with epp as its endpoint picker.

``epp envoy-config --config epp.yaml`` prints it; :func:`render` is the library entry point.
Every choice below was checked against the real Envoy 1.40 binary (``tests/unit/
test_envoy_config.py`` runs traffic through it); ``envoy/README.md`` explains them for operators.

One module per part: :mod:`~epp.envoy_config.listener` (path normalisation, edge timeouts,
filter chain, routes), :mod:`~epp.envoy_config.ext_proc`, :mod:`~epp.envoy_config.auth`
(jwt_authn, ext_authz), :mod:`~epp.envoy_config.replies` (Envoy's own replies as JSON errors),
:mod:`~epp.envoy_config.limits` (circuit breakers, overload manager),
:mod:`~epp.envoy_config.pool` (the pool and overflow clusters),
:mod:`~epp.envoy_config.epp_cluster`, :mod:`~epp.envoy_config.render` (the assembled
bootstrap) and :mod:`~epp.envoy_config.cli` (``epp envoy-config``).

The pieces, in request order:

* **the listener** normalises the path (RFC 3986 dot segments, merged slashes; an escaped
  slash is refused) before any filter runs, so epp and the replica see the same path and epp
  matches the API on it exactly. Limits from the ``edge`` section: per-connection buffers,
  request, header and idle timeouts, circuit breakers on every cluster, and an overload
  manager that answers 503 before Envoy's heap runs out (docs/deploy.md, edge limits).
* **header_mutation before ext_proc** strips the control headers a client could send
  (``x-gateway-destination-endpoint`` and friends), so epp never sees a forged answer and the
  upstream never receives one, and every identity and latency-target header (priority,
  objective, fairness id, ``x-llm-d-slo-*``) unless ``request.trusted_headers`` says a gateway
  in front sets them.
* **jwt_authn / ext_authz** (``request.jwt`` / ``request.auth_service``), when configured,
  authenticate the request and set the identity headers from the token's claims or the
  service's answer: after the strip, so only their values reach epp (docs/identity.md).
* **ext_proc** streams the request to epp (cluster ``epp``), and the response back to it
  (:mod:`~epp.envoy_config.ext_proc`). Requests never reach a replica epp did not choose: epp's
  answer comes back as ``envoy.lb`` dynamic metadata (applied only because the namespace is
  listed in ``metadata_options.receiving_namespaces``) and without it the pool's balancer
  returns no host (503). On top of that, full-duplex mode fails closed (``failure_mode_allow:
  false``: 500/504 when epp is unreachable or silent). Buffered mode sets ``failure_mode_allow:
  true`` so that an epp dying while a response streams does not cut the response (measured: with
  ``false`` the client's stream is reset, with ``true`` it completes; docs/response-path.md); a
  request epp never answered still fails, with 503 from the pool. The stream stays open until
  the response is complete (``response_trailer_mode: SEND``).
* **route ``/``** has no timeout (``timeout: 0s``: a generation may run for minutes) and an
  idle timeout of ``edge.stream_idle_timeout_s`` (long: silent when not streamed), and a retry
  policy with ``num_retries =
  routing.fallbacks``, so a replica that answers 5xx, resets or cannot be reached makes Envoy
  try the next entry of epp's list (only before the response has begun). It also adds
  ``x-gateway-destination-endpoint-served: %UPSTREAM_HOST%`` to the response for epp, which
  the header_mutation filter strips before the client sees it.
* **ext_proc on the response**: headers and the streamed body go to epp on the same stream
  (status, served endpoint, token timings, usage; docs/response-path.md). Envoy's own replies
  skip it (a matcher on the served-endpoint header), so they are written at once.
* **cluster ``pool``** is a STATIC cluster holding every endpoint of every pool, balanced by the
  ``override_host`` policy that reads ONLY the metadata (never the header: metadata cannot be
  set by a client). Each attempt (first try, then each retry) consumes the next address of the
  comma list. When the list is absent or used up, the fallback policy is a subset balancer with
  no subsets and ``NO_FALLBACK``: it never returns a host, so Envoy answers 503 "no healthy
  upstream" instead of silently picking a random replica.
* **clusters ``overflow-NAME``** (spillover, docs/admission.md): each overflow pool's gateway,
  reached by a route ahead of the pool's that matches the ``x-epp-overflow`` header epp sets
  on a spilled request (client copies are stripped by the header_mutation filter).
* **cluster ``epp``** holds one or more epp processes (active-active) over HTTP/2. A stream
  that cannot reach an epp is retried on another (``grpc_service.retry_policy``); gRPC health
  checks on each epp's health port and outlier detection take a dead or draining epp out of
  rotation. Measured: hard-killing one of two epps under load failed only the requests whose
  streams were open on it (tests/e2e/test_active_active.py). With :class:`EppTls` it is
  reached over TLS (mutual with a client certificate), health checks included
  (tests/e2e/test_tls.py).
"""

from __future__ import annotations

from epp.envoy_config.auth import AUTH_CLUSTER, JWT_PROVIDER
from epp.envoy_config.cli import add_subcommand, run
from epp.envoy_config.common import (
    EPP_CLUSTER,
    EXTPROC_SERVICE,
    MODES,
    POOL_CLUSTER,
    Mode,
    parse_address,
)
from epp.envoy_config.epp_cluster import EppTls
from epp.envoy_config.ext_proc import QUEUE_TIMEOUT_MARGIN_MS, ext_proc_settings
from epp.envoy_config.pool import FAIL_OPEN_KEY, overflow_cluster
from epp.envoy_config.render import bootstrap, render, seed_eds

__all__ = [
    "AUTH_CLUSTER",
    "EPP_CLUSTER",
    "EXTPROC_SERVICE",
    "FAIL_OPEN_KEY",
    "JWT_PROVIDER",
    "MODES",
    "POOL_CLUSTER",
    "QUEUE_TIMEOUT_MARGIN_MS",
    "EppTls",
    "Mode",
    "add_subcommand",
    "bootstrap",
    "ext_proc_settings",
    "overflow_cluster",
    "parse_address",
    "render",
    "run",
    "seed_eds",
]
