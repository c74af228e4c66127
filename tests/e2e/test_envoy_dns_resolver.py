"""Envoy's name-resolved clusters, as ``epp envoy-config`` renders them, keep their hosts when
a lookup suddenly finds no such name, and still follow real changes.

A container runtime's resolv.conf names its embedded DNS server and the host's; while the
embedded one reloads (a container joining the network) a lookup can fall through to the host's
server, which answers NXDOMAIN for the service. With Envoy's default resolver (c-ares) a
STRICT_DNS cluster takes that as "no hosts" and answers 503 until the next refresh: the compose
stack lost its pool that way during ``up --scale``. The rendered clusters use getaddrinfo,
which reports the missing name as a failed lookup instead (docs/discovery.md).

Envoy runs in its own mount namespace whose /etc/hosts the test rewrites and whose
nsswitch.conf reads only that file, so a missing name is missing at once and no DNS server is
asked. Needs root (``unshare --mount``), as CI has.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from epp.config import parse_config
from epp.devstack import free_port
from epp.envoy_config import render
from tests.e2e.fleet import wait_until
from tests.helpers.envoy import EnvoyProcess

NAME = "sim.hosts.test"
# Mount the two files over the namespace's own, then become Envoy.
MOUNT = (
    'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/nsswitch.conf && shift 2 && exec "$@"'
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unshare --mount needs root")


def pool_hosts(envoy: EnvoyProcess) -> set[str]:
    _, text = envoy.admin_get("/clusters")
    return set(re.findall(r"^pool::(\d+\.\d+\.\d+\.\d+:\d+)::", text, re.MULTILINE))


def failed_lookups(envoy: EnvoyProcess) -> int:
    _, text = envoy.admin_get("/stats?filter=^cluster\\.pool\\.update_failure$")
    return int(text.split(":")[1])


def test_pool_keeps_its_hosts_while_the_name_is_missing(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    nsswitch = tmp_path / "nsswitch.conf"
    nsswitch.write_text("hosts: files\n")

    def publish(*ips: str) -> None:
        # Written in place: the bind mount follows the file's inode.
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{ip} {NAME}\n" for ip in ips))

    publish("127.0.0.2", "127.0.0.3")
    config = parse_config(
        {
            "models": {"m": {"pools": ["main"]}},
            "pools": {
                "main": {"discovery": {"dns": {"name": NAME, "port": 8000, "interval": 0.2}}}
            },
        }
    )
    admin = free_port()
    text = render(
        config,
        listen=f"127.0.0.1:{free_port()}",
        admin=f"127.0.0.1:{admin}",
        extproc=[f"127.0.0.1:{free_port()}"],
    )
    wrapper = ["unshare", "--mount", "sh", "-c", MOUNT, "sh", str(hosts), str(nsswitch)]
    with EnvoyProcess.start(text, admin, tmp_path, wrapper=wrapper) as envoy:
        both = {"127.0.0.2:8000", "127.0.0.3:8000"}
        wait_until(lambda: pool_hosts(envoy) == both, 10, "Envoy to resolve both addresses")

        publish()  # the name is gone for a moment: five refresh intervals
        failed = failed_lookups(envoy)
        for _ in range(20):
            time.sleep(0.05)
            assert pool_hosts(envoy) == both
        # Those lookups did happen, and failed (not "no hosts").
        assert failed_lookups(envoy) >= failed + 3

        publish("127.0.0.3")  # a real change is still followed
        wait_until(lambda: pool_hosts(envoy) == {"127.0.0.3:8000"}, 10, "Envoy to drop 127.0.0.2")
