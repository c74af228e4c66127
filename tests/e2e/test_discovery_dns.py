"""A DNS-discovered pool under load: replicas join and leave by DNS alone, and both epp and
the real Envoy follow without a restart or a failed request.

The name is served by a local DNS server (tests/helpers/dns_server.py) that both epp
(``resolver:``) and Envoy (c-ares, rendered by ``epp envoy-config``) ask.
"""

from __future__ import annotations

import time
from pathlib import Path

from epp.devstack import Stack, free_port
from tests.e2e.fleet import Load, envoy_ready, epp_ready_endpoints, start_replica, wait_until
from tests.helpers.dns_server import DnsServer

INTERVAL = 0.5
IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


def test_dns_pool_follows_added_and_removed_replicas(tmp_path: Path) -> None:
    port = free_port()
    addr = {ip: f"{ip}:{port}" for ip in IPS}
    with DnsServer() as dns:
        dns.set("sim.test", IPS[:2])
        stack = Stack(
            tmp_path,
            replicas=0,
            config_extra={
                "pools": {
                    "main": {
                        "discovery": {
                            "dns": {
                                "name": "sim.test",
                                "port": port,
                                "interval": INTERVAL,
                                "resolver": dns.address,
                            }
                        }
                    }
                }
            },
        )
        with stack:
            stack.write_configs()
            for ip in IPS:
                start_replica(stack, ip, port)
            stack.start_epp(0)
            stack.start_envoy()
            wait_until(lambda: envoy_ready(stack), 20, "Envoy")
            wait_until(
                lambda: epp_ready_endpoints(stack) == {addr[IPS[0]], addr[IPS[1]]},
                20,
                "epp to find and scrape the first two replicas",
            )
            with Load(stack) as load:
                wait_until(lambda: load.served_since(0) >= {addr[IPS[0]], addr[IPS[1]]}, 10, "both")

                # Scale up: the third address appears in DNS.
                added = time.monotonic()
                dns.set("sim.test", IPS)
                wait_until(lambda: load.first_served_by(addr[IPS[2]], added), 10, "new replica")
                reached = load.first_served_by(addr[IPS[2]], added)
                assert reached is not None

                # Scale down: the first address leaves DNS (its process keeps running, as a
                # terminating container might); no request may reach it once epp dropped it.
                removed = time.monotonic()
                dns.set("sim.test", IPS[1:])
                wait_until(lambda: addr[IPS[0]] not in epp_ready_endpoints(stack), 5, "removal")
                gone = time.monotonic()
                time.sleep(1.0)  # traffic observed after the removal
                assert addr[IPS[0]] not in load.served_since(gone)
                assert load.served_since(gone) == {addr[IPS[1]], addr[IPS[2]]}
            assert load.failures() == [], load.failures()[:5]
            # How soon: printed, not asserted (a busy machine stretches wall-clock time);
            # tests/unit/test_discovery_dns.py checks that a change lands at the next lookup.
            print(
                f"requests {len(load.outcomes)}, new replica served "
                f"{reached - added:.2f}s after the DNS change, removal seen by epp "
                f"{gone - removed:.2f}s after"
            )
