"""A tiny authoritative DNS server on loopback whose answers a test changes at will.

``with DnsServer() as dns: dns.set("sim.test", ["127.0.0.2", "::1"])`` then point a resolver
(epp's ``resolver: 127.0.0.1:<dns.port>``, Envoy's c-ares) at it. It answers A and AAAA
queries over UDP from the current table with TTL 0, NOERROR with no records for a known name
without that record type, and NXDOMAIN for unknown names. ``blank(name, questions)`` answers
NXDOMAIN to the next ``questions`` questions about a name that has addresses (a resolver that
forgets a name for a moment). It runs in its own thread, so it serves epp and Envoy
subprocesses as well as code on the test's event loop. ``queries`` counts the questions seen per
name.
"""

from __future__ import annotations

import collections
import ipaddress
import socketserver
import threading
from collections.abc import Iterable
from types import TracebackType

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsServer:
    def __init__(self) -> None:
        self._records: dict[str, list[str]] = {}
        self._blanks: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.queries: collections.Counter[str] = collections.Counter()
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data, sock = self.request
                sock.sendto(owner._answer(data), self.client_address)

        self._server = socketserver.ThreadingUDPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, ips: Iterable[str]) -> None:
        """Answer ``name`` with ``ips`` from now on (an empty list: NXDOMAIN)."""
        with self._lock:
            self._records[_key(name)] = list(ips)

    def blank(self, name: str, questions: int) -> None:
        """Answer NXDOMAIN to the next ``questions`` questions about ``name``."""
        with self._lock:
            self._blanks[_key(name)] = questions

    def _answer(self, data: bytes) -> bytes:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        name = _key(question.name.to_text())
        self.queries[name] += 1
        with self._lock:
            ips = list(self._records.get(name, []))
            if self._blanks[name] > 0:
                self._blanks[name] -= 1
                ips = []
        if not ips:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        version = 4 if question.rdtype == dns.rdatatype.A else 6
        matching = [ip for ip in ips if ipaddress.ip_address(ip).version == version]
        if question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA) and matching:
            rdtype = dns.rdatatype.to_text(question.rdtype)
            response.answer.append(
                dns.rrset.from_text_list(question.name, 0, "IN", rdtype, matching)
            )
        return response.to_wire()

    def __enter__(self) -> DnsServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()


def _key(name: str) -> str:
    return name.rstrip(".").lower()
