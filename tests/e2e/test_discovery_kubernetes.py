"""Kubernetes discovery end to end: fake pods with loopback addresses come and go behind a
local Kubernetes API (tests/helpers/fake_kube.py), two epp processes follow the InferencePool,
write Envoy's EDS file, and the real Envoy routes to simulated replicas on 127.0.0.x without a
restart and without a failed request while a ready endpoint exists: pods added, made unready,
deleted, missed during a partition (410, relist), the pool's selector changed, and a Ready pod's
replica crashing (Envoy retries epp's fallback until scrapes mark it unready). Then one epp is
killed and the other keeps Envoy's membership current.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from epp.config import parse_config
from epp.devstack import Stack, free_port
from epp.envoy_config import render, seed_eds
from tests.e2e.fleet import Load, envoy_ready, epp_ready_endpoints, start_replica, wait_until
from tests.helpers.fake_kube import FakeKube, inference_pool, pod

IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
APP = {"app": "vllm"}
# Failed scrapes before a replica is unready: none of a test's length at first, so that a crashed
# replica stays a candidate until requests epp sent there have been retried; then the default.
NEVER_UNREADY = 1_000_000


def envoy_hosts(stack: Stack) -> set[str]:
    """Hosts of Envoy's ``pool`` cluster, from its admin API."""
    url = f"http://127.0.0.1:{stack.admin_port}/clusters?format=json"
    with urllib.request.urlopen(url, timeout=1) as resp:
        data = json.load(resp)
    hosts = set()
    for cluster in data["cluster_statuses"]:
        if cluster["name"] == "pool":
            for host in cluster.get("host_statuses", []):
                sock = host["address"]["socket_address"]
                hosts.add(f"{sock['address']}:{sock['port_value']}")
    return hosts


def envoy_stat(stack: Stack, name: str) -> int:
    url = f"http://127.0.0.1:{stack.admin_port}/stats?filter=^{name}$"
    with urllib.request.urlopen(url, timeout=1) as resp:
        text = resp.read().decode()
    values = [int(line.split(": ")[1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def healthy_epps(stack: Stack) -> int:
    """epp processes Envoy's health checks currently pass."""
    url = f"http://127.0.0.1:{stack.admin_port}/clusters"
    with urllib.request.urlopen(url, timeout=1) as resp:
        lines = resp.read().decode().splitlines()
    return sum(1 for line in lines if line.startswith("epp::") and line.endswith("::healthy"))


def epp_yaml(stack: Stack, api_url: str) -> dict[str, Any]:
    data = stack.epp_config()
    data["pools"] = {
        "main": {
            "discovery": {
                "kubernetes": {"pool_name": "vllm-pool", "namespace": "default", "api_url": api_url}
            }
        }
    }
    return data


def write_configs(stack: Stack, api_url: str, eds_dir: Path) -> None:
    data = epp_yaml(stack, api_url)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    stack.config_path.write_text(yaml.safe_dump(data))
    config = parse_config(data, str(stack.config_path))
    seed_eds(eds_dir, config)
    stack.envoy_path.write_text(
        render(
            config,
            listen=f"127.0.0.1:{stack.envoy_port}",
            admin=f"127.0.0.1:{stack.admin_port}",
            extproc=[f"127.0.0.1:{p}" for p, _, _ in stack.epp_ports],
            health=[f"127.0.0.1:{h}" for _, h, _ in stack.epp_ports],
            eds_dir=str(eds_dir),
        )
    )


def test_pods_come_and_go_through_envoy(tmp_path: Path) -> None:
    port = free_port()
    addr = {ip: f"{ip}:{port}" for ip in IPS}
    eds_dir = tmp_path / "eds"
    figures: dict[str, float] = {}
    with FakeKube() as kube:
        kube.put("inferencepools", inference_pool("vllm-pool", APP, [port]))
        kube.put("pods", pod("a", IPS[0], APP))
        kube.put("pods", pod("b", IPS[1], APP))
        stack = Stack(
            tmp_path / "stack",
            replicas=0,
            epp_count=2,
            epp_args=["--eds-dir", str(eds_dir)],
            # A crashed replica stays a candidate until the test lowers the threshold, so the
            # fallback retries are exercised however slowly a busy machine sends requests.
            config_extra={"scrape": {"failure_threshold": NEVER_UNREADY}},
        )
        with stack:
            write_configs(stack, kube.url, eds_dir)
            for ip in IPS:
                start_replica(stack, ip, port)
            stack.start_epp(0)
            stack.start_epp(1)
            stack.start_envoy()
            wait_until(lambda: envoy_ready(stack), 20, "Envoy")
            wait_until(
                lambda: all(
                    epp_ready_endpoints(stack, i) == {addr[IPS[0]], addr[IPS[1]]} for i in (0, 1)
                ),
                20,
                "both epps to discover and scrape pods a and b",
            )
            wait_until(lambda: envoy_hosts(stack) == {addr[IPS[0]], addr[IPS[1]]}, 5, "EDS")

            def scraped_everywhere(address: str) -> None:
                wait_until(
                    lambda: all(address in epp_ready_endpoints(stack, i) for i in (0, 1)),
                    10,
                    f"both epps to scrape {address}",
                )

            def change(what: str, expected_hosts: set[str], act: Callable[[], None]) -> float:
                """Apply a change; seconds until Envoy's pool cluster holds ``expected`` and
                neither epp still routes to a host outside it (each epp follows the API server
                on its own, Envoy the EDS file one of them writes)."""
                started = time.monotonic()
                act()
                took = wait_until(
                    lambda: (
                        envoy_hosts(stack) == expected_hosts
                        and all(epp_ready_endpoints(stack, i) <= expected_hosts for i in (0, 1))
                    ),
                    10,
                    what,
                )
                figures[what] = took
                return started

            with Load(stack) as load:
                wait_until(lambda: load.served_since(0) >= {addr[IPS[0]], addr[IPS[1]]}, 10, "a, b")

                # A pod joins: served through Envoy soon after (scraped first).
                joined = change(
                    "pod added",
                    {addr[IPS[0]], addr[IPS[1]], addr[IPS[2]]},
                    lambda: kube.put("pods", pod("c", IPS[2], APP)),
                )
                wait_until(lambda: load.first_served_by(addr[IPS[2]], joined), 5, "c served")
                scraped_everywhere(addr[IPS[2]])  # before a and b go: one must stay ready
                figures["pod added -> first request on it"] = (
                    load.first_served_by(addr[IPS[2]], joined) or 0
                ) - joined

                # A pod turns unready, another is deleted: neither is used from then on.
                unready = change(
                    "pod unready",
                    {addr[IPS[1]], addr[IPS[2]]},
                    lambda: kube.put("pods", pod("a", IPS[0], APP, ready=False)),
                )
                deleted = change(
                    "pod deleted",
                    {addr[IPS[2]]},
                    lambda: kube.delete("pods", "b"),
                )

                # Missed events: a partition, changes, compaction; the watch gets 410 and relists.
                def gap() -> None:
                    kube.partition()
                    kube.put("pods", pod("d", IPS[3], APP))
                    kube.compact()
                    kube.heal()

                relisted = change("410 Gone relist", {addr[IPS[2]], addr[IPS[3]]}, gap)
                scraped_everywhere(addr[IPS[3]])

                # The pool's selector changes to one that keeps pod d and adds pod e: c leaves
                # at once, e is used once scraped. (A selector that keeps no pod epp has already
                # scraped would leave no ready endpoint for one scrape: docs/discovery.md.)
                kube.put("pods", pod("d", IPS[3], {**APP, "tier": "next"}))
                kube.put("pods", pod("e", IPS[4], {"tier": "next"}))
                moved = change(
                    "pool selector changed",
                    {addr[IPS[3]], addr[IPS[4]]},
                    lambda: kube.put(
                        "inferencepools", inference_pool("vllm-pool", {"tier": "next"}, [port])
                    ),
                )
                wait_until(lambda: load.first_served_by(addr[IPS[4]], moved), 5, "e served")
                scraped_everywhere(addr[IPS[4]])

                # The replica epp picked last (d or e) crashes while Kubernetes still calls its
                # pod Ready: until epp's scrapes mark it unready, requests epp sends there are
                # refused and Envoy retries them on epp's fallback, the other one, a member of
                # the EDS cluster.
                victim = load.outcomes[-1].served_by
                assert victim in (addr[IPS[3]], addr[IPS[4]])
                survivor = addr[IPS[3]] if victim == addr[IPS[4]] else addr[IPS[4]]
                retries = envoy_stat(stack, "cluster.pool.upstream_rq_retry")
                stack.procs[f"sim-{victim.rpartition(':')[0]}"].kill()  # returns once it is gone
                crashed = time.monotonic()
                wait_until(
                    lambda: envoy_stat(stack, "cluster.pool.upstream_rq_retry") > retries,
                    10,
                    "a request epp sent to the crashed replica, retried on the fallback",
                )
                # Now its failed scrapes count: the default threshold, by a reload of both epps.
                data = epp_yaml(stack, kube.url)
                data["scrape"] = {}
                stack.config_path.write_text(yaml.safe_dump(data))
                for i in (0, 1):
                    os.kill(stack.procs[f"epp{i}"].popen.pid, signal.SIGHUP)
                wait_until(
                    lambda: all(victim not in epp_ready_endpoints(stack, i) for i in (0, 1)),
                    10,
                    "both epps to mark the crashed replica unready",
                )
                figures["replica crashed -> retried, reloaded, unready in both epps"] = (
                    time.monotonic() - crashed
                )
                retried = envoy_stat(stack, "cluster.pool.upstream_rq_retry") - retries
                time.sleep(0.5)  # traffic after the last change, observed below

            assert load.failures() == [], load.failures()[:5]
            # Requests started once Envoy and both epps had applied the change (ended after it
            # plus a slack would count a request a busy machine slowed down, sent before it).
            after = {
                addr[IPS[0]]: unready + figures["pod unready"],
                addr[IPS[1]]: deleted + figures["pod deleted"],
            }
            for gone, since in after.items():
                assert gone not in load.served_if_started_after(since), gone
            assert load.served_if_started_after(moved + figures["pool selector changed"]) <= {
                addr[IPS[3]],
                addr[IPS[4]],
            }
            assert relisted > 0
            # Requests epp sent to the crashed replica were retried on the fallback.
            assert retried > 0
            assert victim not in load.served_if_started_after(crashed)

            # One epp dies: the other keeps writing the EDS file, Envoy keeps following.
            stack.procs["epp0"].kill()
            change(
                "pod added, one epp dead",
                {addr[IPS[3]], addr[IPS[4]], addr[IPS[0]]},
                lambda: kube.put("pods", pod("a", IPS[0], {"tier": "next"})),
            )
            # The other epp routes to it once scraped. (What a request in flight on the killed
            # epp sees is tests/e2e/test_active_active.py's subject: wait until Envoy's health
            # checks took the dead epp out.)
            wait_until(lambda: addr[IPS[0]] in epp_ready_endpoints(stack, 1), 5, "epp1 scrape")
            wait_until(lambda: healthy_epps(stack) == 1, 5, "Envoy to mark the dead epp unhealthy")
            with Load(stack) as after_kill:
                wait_until(
                    lambda: after_kill.served_since(0) >= {addr[IPS[0]], survivor},
                    10,
                    "both served after the kill",
                )
            assert after_kill.failures() == [], after_kill.failures()[:5]
            print(
                f"requests {len(load.outcomes)} + {len(after_kill.outcomes)}, "
                f"{retried} retried on the fallback after the replica crash"
            )
            for what, seconds in figures.items():
                print(f"  {what}: {seconds * 1000:.0f} ms")


def test_pool_name_flag_with_a_kubeconfig(tmp_path: Path) -> None:
    """GIE-style flags: the file's only pool is static, ``--pool-name`` makes it follow the
    InferencePool, with credentials from ``--kubeconfig``."""
    port = free_port()
    with FakeKube() as kube:
        kube.put("inferencepools", inference_pool("vllm-pool", APP, [port]))
        kube.put("pods", pod("a", IPS[0], APP))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
                    "users": [{"name": "me", "user": {}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
                    "current-context": "fake",
                }
            )
        )
        stack = Stack(
            tmp_path / "stack",
            replicas=0,
            epp_args=[
                "--pool-name",
                "vllm-pool",
                "--pool-namespace",
                "default",
                "--kubeconfig",
                str(kubeconfig),
            ],
        )
        with stack:
            stack.workdir.mkdir(parents=True)
            # A static pool in the file: the flag replaces its source.
            data = stack.epp_config()
            data["pools"] = {"main": {"endpoints": [f"127.0.0.1:{free_port()}"]}}
            stack.config_path.write_text(yaml.safe_dump(data))
            start_replica(stack, IPS[0], port)
            stack.start_epp(0)
            wait_until(
                lambda: epp_ready_endpoints(stack) == {f"{IPS[0]}:{port}"}, 20, "pod a via flags"
            )
            kube.put("pods", pod("a", IPS[0], APP, ready=False))
            wait_until(lambda: epp_ready_endpoints(stack) == set(), 10, "pod a gone")
