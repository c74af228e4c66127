"""In-flight counts every epp process of a group shares, so each sees the whole fleet's work.

An epp process counts the requests it routed and has not seen finish
(:class:`~epp.state.inflight.InflightTracker`). With several processes behind one gateway each
would see only its own share and all of them would pile onto the replica that looks idle to
each. Every sync tick a process writes its counts to its own hash (``{p}:load:<id>``, field
per endpoint, value ``"requests tokens"``; a second field ``prefill|<endpoint>`` holds
``"tokens,requests"`` still waiting for their first token, in a form older versions skip as
unreadable) with a TTL, reads the other members' hashes and sets ``InflightTracker.remote`` to
their sum. A process that dies stops renewing its hash and its counts vanish with the TTL; the
requests it had in flight failed with it anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from redis.typing import EncodableT, FieldT

from epp.state.inflight import Load

_PREFILL = "prefill|"


def encode(loads: Mapping[str, Load]) -> dict[FieldT, EncodableT]:
    """Hash fields for one process's counts (zeros included: they overwrite older counts)."""
    fields: dict[FieldT, EncodableT] = {}
    for address, load in loads.items():
        fields[address] = f"{load.requests} {load.tokens}"
        fields[_PREFILL + address] = f"{load.prefill},{load.waiting}"
    return fields


def total(hashes: Sequence[Mapping[bytes, bytes]]) -> dict[str, Load]:
    """The sum of other processes' hashes; unreadable fields count as nothing."""
    out: dict[str, Load] = {}
    for fields in hashes:
        for raw_address, raw_value in fields.items():
            name = raw_address.decode()
            prefill = name.startswith(_PREFILL)
            try:
                if prefill:
                    first, second = (int(v) for v in raw_value.split(b","))
                else:
                    first, second = (int(v) for v in raw_value.split())
            except ValueError:
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
