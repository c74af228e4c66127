"""Every Redis key the epp processes of one group share, in one place.

``prefix`` is ``store.key_prefix`` as a hash tag (``{epp}``, see
:func:`~epp.state.shared.connect.hash_tag`), so all keys hash to one Cluster slot.

==============================  ========  =====================================================
key                             type      written by / lifetime
==============================  ========  =====================================================
``{p}:ep:<host:port>``          string    endpoint state JSON (RedisStore); PX 5 s, rewritten
                                          by the lease owner on every change
``{p}:lease:<host:port>``       string    id of the process that scrapes the endpoint;
                                          ``SET NX PX`` 3 intervals, renewed every interval
``{p}:members``                 zset      process id -> Redis time (ms) of its last tick;
                                          older than the lease TTL is pruned; key PX lease TTL
``{p}:load:<process id>``       hash      endpoint -> "requests tokens" the process has in
                                          flight; PX 10 intervals (a dead process's expire)
``{p}:queue:<process id>``      string    JSON rows of the process's flow-control demand
                                          (:mod:`epp.state.shared.queues`); PX 10 intervals
``{p}:latency:<process id>``    hash      endpoint -> JSON of the process's own latency
                                          evidence (:mod:`epp.state.latency`), rewritten
                                          every second; PX 10 s
``{p}:budget:<kind>:<tenant>``  hash      tenant budget window (:mod:`epp.admission.budget_sync`):
                                          bucket index -> amount granted or charged;
                                          PX window + 2 buckets
``{p}:picks``                   stream    prefix-index insertions, session bindings and
                                          passive-health verdicts (ejections, readmissions), up
                                          to 32 per entry; ``MAXLEN ~ 1024``, PX 1 h
==============================  ========  =====================================================

What each value holds carries a schema version and is checked on read
(:mod:`epp.state.shared.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str

    def lease(self, address: str) -> str:
        return f"{self.prefix}:lease:{address}"

    @property
    def members(self) -> str:
        return f"{self.prefix}:members"

    def load(self, member: str) -> str:
        return f"{self.prefix}:load:{member}"

    def queue(self, member: str) -> str:
        return f"{self.prefix}:queue:{member}"

    def latency(self, member: str) -> str:
        return f"{self.prefix}:latency:{member}"

    def budget(self, kind: str, tenant: str) -> str:
        return f"{self.prefix}:budget:{kind}:{tenant}"

    @property
    def picks(self) -> str:
        return f"{self.prefix}:picks"
