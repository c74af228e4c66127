"""A pool whose replicas are the A/AAAA records of one name, re-resolved every ``interval``.

This is how a compose service scaled to N (``docker compose up --scale sim=N``) or a Kubernetes
headless Service is found. Without an explicit resolver the system's ``getaddrinfo`` answers
(``/etc/hosts``, search domains, the runtime's embedded DNS), as any client in that container
would resolve the name; with ``resolver: ip:port`` dnspython asks that server directly, which
is what tests use to change the answers under a running epp.

A name that does not exist (NXDOMAIN / no records) means no replicas, a service scaled to zero,
once the next lookup agrees: a single such answer between answers with addresses is a resolver
hiccup, the typical one a container runtime's: its resolv.conf names the embedded DNS server and
the host's, and while the embedded one reloads (a container joining the network) a lookup falls
through to the host's server, which does not know the service. Any other failure (timeout,
SERVFAIL) keeps the last set published, so a resolver hiccup never empties a healthy pool; the
replicas' own scrapes decide their readiness.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import dns.asyncresolver
import dns.rdatatype
import dns.resolver

from epp.discovery.source import Publish
from epp.discovery.spec import DnsSpec, format_endpoint

log = logging.getLogger(__name__)


class NoSuchName(Exception):
    """The name has no address records: the pool is empty."""


class DnsSource:
    def __init__(self, spec: DnsSpec) -> None:
        self._spec = spec
        self._resolver: dns.asyncresolver.Resolver | None = None
        if spec.resolver is not None:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [spec.resolver[0]]
            self._resolver.port = spec.resolver[1]
            # One attempt per tick: a lost answer is retried at the next interval anyway.
            self._resolver.lifetime = max(0.2, min(spec.interval, 5.0))

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        last: frozenset[str] | None = None
        failing = False
        # An answer without addresses is believed when it repeats (module docstring).
        unconfirmed_empty = False
        next_at = loop.time()
        while True:
            try:
                ips = await self.resolve_or_empty()
            except Exception as exc:  # any resolver failure: keep the last set, try next tick
                if not failing:
                    log.warning(
                        "DNS lookup of %s failed, keeping its %d endpoints: %s",
                        self._spec.name,
                        len(last or ()),
                        exc or type(exc).__name__,
                    )
                failing = True
            else:
                failing = False
                current = frozenset(format_endpoint(ip, self._spec.port) for ip in ips)
                if not current and last and not unconfirmed_empty:
                    unconfirmed_empty = True
                    log.info(
                        "DNS %s: no addresses; keeping its %d endpoints unless the next lookup "
                        "agrees",
                        self._spec.name,
                        len(last),
                    )
                else:
                    unconfirmed_empty = False
                    if current != last:
                        log.info(
                            "DNS %s: %d endpoints (%s)",
                            self._spec.name,
                            len(current),
                            ", ".join(sorted(current)) or "none",
                        )
                        publish(current)
                        last = current
            # Fixed ticks, not sleeps after each lookup: a change is seen within one interval.
            next_at = max(next_at + self._spec.interval, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def resolve_or_empty(self) -> set[str]:
        try:
            return await self.resolve()
        except NoSuchName:
            return set()

    async def resolve(self) -> set[str]:
        """The name's current IPv4 and IPv6 addresses; NoSuchName if it has none."""
        if self._resolver is None:
            return await _system_resolve(self._spec.name)
        ips: set[str] = set()
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            try:
                answer = await self._resolver.resolve(self._spec.name, rdtype, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            ips.update(r.to_text() for r in answer)
        if not ips:
            raise NoSuchName(self._spec.name)
        return ips


async def _system_resolve(name: str) -> set[str]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise NoSuchName(name) from None
        raise
    return {str(info[4][0]) for info in infos}
