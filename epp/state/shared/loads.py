"""In-flight counts every epp process of a group shares, so each sees the whole fleet's work.

An epp process counts the requests it routed and has not seen finish
(:class:`~epp.state.inflight.InflightTracker`). With several processes behind one gateway each
would see only its own share and all of them would pile onto the replica that looks idle to
each. Every sync tick a process writes its counts to its own hash (``{p}:load:<id>``, field
per endpoint, value ``"requests tokens"``; a second field ``prefill|<endpoint>`` holds
``"tokens,requests"`` still waiting for their first token, in a form older versions skip as
unreadable; a field ``_v`` holds the schema version, :mod:`epp.state.shared.wire`) with a
TTL, reads the other members' hashes and sets ``InflightTracker.remote`` to
their sum. A process that dies stops renewing its hash and its counts vanish with the TTL; the
requests it had in flight failed with it anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from redis.typing import EncodableT, FieldT

from epp.state.inflight import Load
from epp.state.shared import wire

_PREFILL = "prefill|"


def encode(loads: Mapping[str, Load]) -> dict[FieldT, EncodableT]:
    """Hash fields for one process's counts (zeros included: they overwrite older counts);
    none without counts."""
    fields: dict[FieldT, EncodableT] = {}
    for address, load in loads.items():
        fields[address] = f"{load.requests} {load.tokens}"
        fields[_PREFILL + address] = f"{load.prefill},{load.waiting}"
    return wire.stamp_hash(fields) if fields else fields


def total(hashes: Sequence[Mapping[bytes, bytes]]) -> dict[str, Load]:
    """The sum of other processes' hashes; unreadable fields count as nothing (and are
    counted in ``epp_shared_state_rejected_total``)."""
    out: dict[str, Load] = {}
    for stamped in hashes:
        for raw_address, raw_value in wire.open_hash("load", stamped).items():
            try:
                name = raw_address.decode()
                prefill = name.startswith(_PREFILL)
                first, second = (int(v) for v in raw_value.split(b"," if prefill else None))
                if first < 0 or second < 0:
                    raise ValueError(f"negative count {raw_value!r}")
            except ValueError as exc:
                wire.refused("load", exc)
                continue
            address = name.removeprefix(_PREFILL)
            load = out.get(address)
            if load is None:
                load = out[address] = Load()
            if prefill:
                load.prefill += first
                load.waiting += second
            else:
                load.requests += first
                load.tokens += second
    return out
