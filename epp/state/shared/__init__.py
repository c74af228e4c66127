"""Active-active epp: several processes act as one picker by sharing state through Redis.

- :mod:`~epp.state.shared.client`: every Redis client epp opens, and the one backoff policy.
- :mod:`~epp.state.shared.connect`: standalone, Sentinel or Cluster Redis from one URL.
- :mod:`~epp.state.shared.keys`: the key schema (all keys in one Cluster slot).
- :mod:`~epp.state.shared.lease`: each endpoint scraped by one process of the group.
- :mod:`~epp.state.shared.loads`: in-flight counts summed over the group.
- :mod:`~epp.state.shared.picks`: what picks add to the replicated states
  (:mod:`epp.state.registry`: the prefix indexes, the session table) and passive health,
  replayed by every other process through a stream.
- :mod:`~epp.state.shared.sessions`: the session table whose bindings can be replayed.
- :mod:`~epp.state.shared.sync`: per process, leases and in-flight counts every scrape interval,
  and the pick stream's tasks.
- :mod:`~epp.state.shared.wire`: the versioned framing of every payload and the checks on read.

Endpoint states travel through :class:`~epp.state.redis_store.RedisStore`. The precise prefix
index needs nothing from here: each process subscribes to every engine's KV events itself (ZMQ
PUB fans out to any number of subscribers), so all of them see the same events.

Import from the submodules: this package imports nothing itself, so importing one of them
does not pull in the others.
"""
