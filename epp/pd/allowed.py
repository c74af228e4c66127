"""Which prefill replicas a sidecar may call: never anything a client names (docs/pd.md).

The prefill header comes from epp, and Envoy strips client copies; the sidecar still refuses a
target outside its pool, so that a request reaching it another way cannot make it call an
arbitrary address. The list is the ``--prefill`` addresses plus, from an epp configuration, the
prefill-role endpoints of its static pools and the addresses of its DNS pools whose role is
prefill, plus the addresses of ``--prefill-dns`` names (a Kubernetes headless Service of the
prefill pods), re-resolved every ``interval``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable

from epp.config import Config
from epp.discovery.spec import DnsSpec, format_endpoint

log = logging.getLogger(__name__)


class Allowed:
    def __init__(
        self,
        addresses: Iterable[str] = (),
        config: Config | None = None,
        names: Iterable[DnsSpec] = (),
    ) -> None:
        self._static = frozenset(addresses)
        self._dns: list[DnsSpec] = list(names)
        if config is not None:
            self._static |= {a for a, role in config.roles.items() if role == "prefill"}
            self._dns += [
                s
                for s in config.discovery.values()
                if isinstance(s, DnsSpec) and s.role == "prefill"
            ]
        self._resolved: frozenset[str] = frozenset()
        self._by_name: dict[str, frozenset[str]] = {}

    def __contains__(self, address: str) -> bool:
        return address in self._static or address in self._resolved

    async def follow_dns(self) -> None:
        """Keep the names' addresses current."""
        if not self._dns:
            return
        interval = min(s.interval for s in self._dns)
        while True:
            await self.refresh()
            await asyncio.sleep(interval)

    async def refresh(self) -> None:
        """Look the names up once; a failed lookup keeps that name's last addresses."""
        loop = asyncio.get_running_loop()
        found: set[str] = set()
        for spec in self._dns:
            try:
                infos = await loop.getaddrinfo(spec.name, spec.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("prefill replicas %s: lookup failed: %s", spec.name, exc)
                found |= self._by_name.get(spec.name, frozenset())
                continue
            addresses = frozenset(format_endpoint(str(i[4][0]), spec.port) for i in infos)
            self._by_name[spec.name] = addresses
            found |= addresses
        self._resolved = frozenset(found)
