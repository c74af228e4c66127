"""A real Prometheus (Debian's ``prometheus``) scrapes a real epp under load, with the shipped
rules loaded: every Grafana panel query, every recording or alert expression and the KEDA
example's query return at least one series, and every metric they name exists in what
Prometheus scraped.

Alert expressions compare a signal with a threshold, so on a healthy fleet they are empty by
design; here each comparison gets PromQL's ``bool`` modifier, which keeps the series (0 or 1)
and so still proves the signal exists. Model ``ghost`` has one endpoint that never answers,
and flow control is on (``admission.mode: queue``, short TTL): requests for ``ghost`` wait in
the queue and are dropped at the TTL (503), so the flow-control panels (queue length, wait,
drops by reason, saturation), refusals and an empty pool show up too; tenant ``evals`` is over
its budget (admitted and refused).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.devstack import Stack, free_port, http_ok
from tests.e2e.client import request
from tests.unit.test_deploy_autoscaling import keda_query

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules" / "epp.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "epp.json"
# Every metric our queries name starts like this (PromQL functions and labels never do).
METRIC = re.compile(r"\b(?:epp[_:]|inference_|llm_d_)[A-Za-z0-9_:]*")
# Label lists and matchers, where a label may start like a metric (``inference_pool``).
LABELS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)|\{[^}]*\}")
COMPARISON = re.compile(r"\s(==|!=|>=|<=|>|<)\s")
DEADLINE_SECONDS = 60.0


class Prometheus:
    """``prometheus`` on a free loopback port, scraping epp every second."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:  # under CI=true this skip is a failure (tests/helpers/ci_strict.py)
            pytest.skip("prometheus is needed: apt-get install prometheus (.ci/run does)")
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "epp", "static_configs": [{"targets": targets}]}],
        }
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not http_ok(f"http://127.0.0.1:{self.port}/-/ready"):
            assert self.proc.poll() is None, f"prometheus exited: see {self.log.name}"
            assert time.monotonic() < deadline, f"prometheus not ready in {timeout}s"
            time.sleep(0.1)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{query}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def series(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()


def with_bool(expr: str) -> str:
    """``a > 0.9`` -> ``a > bool 0.9``: the comparison yields 0 or 1 instead of dropping."""
    return COMPARISON.sub(lambda m: f" {m.group(1)} bool ", expr)


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (f"panel {p['title']!r}", t["expr"])
        for p in panels
        if p["type"] != "row"
        for t in p["targets"]
    ]


def rule_queries() -> list[tuple[str, str]]:
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                out.append((f"record {rule['record']}", rule["expr"]))
            else:
                out.append((f"alert {rule['alert']}", with_bool(rule["expr"])))
    return out


def load(stack: Stack, stop: threading.Event) -> None:
    """Streamed and buffered completions, a refused request of each kind, until ``stop``."""
    body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": 8}
    while not stop.is_set():
        request(stack.url, "/v1/completions", {**body, "stream": True})
        request(stack.url, "/v1/completions", body)
        request(stack.url, "/v1/completions", {**body, "model": "nope"})
        request(stack.url, "/v1/completions", {**body, "model": "ghost"})
        request(stack.url, "/v1/completions", {**body, "model": "ghost"}, {"x-priority": "-1"})
        request(stack.url, "/v1/completions", body, {"x-gateway-inference-fairness-id": "evals"})


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    workdir = tmp_path_factory.mktemp("prometheus")
    stack = Stack(
        workdir / "stack",
        config_extra={
            "models": {"ghost": {"pools": ["ghost"]}},
            "pools": {"ghost": {"endpoints": [f"127.0.0.1:{free_port()}"]}},
            "admission": {"mode": "queue", "ttl": 0.3},
            # A tenant over its budget: the budget panels show admitted and refused requests.
            "budgets": {"tenants": {"evals": {"rpm": 2}}, "window_seconds": 5},
            # The priority and tenant headers stand for a gateway in front that sets them.
            "request": {"trusted_headers": True},
        },
        sim_args=["--time-scale", "0.05"],
    )
    stop = threading.Event()
    with stack:
        stack.start()
        prometheus = Prometheus(workdir, [f"127.0.0.1:{m}" for _, _, m in stack.epp_ports])
        prometheus.wait_ready()
        worker = threading.Thread(target=load, args=(stack, stop), daemon=True)
        worker.start()
        try:
            yield prometheus
        finally:
            stop.set()
            worker.join(timeout=30)
            prometheus.stop()


def wait_for_series(prometheus: Prometheus, queries: list[tuple[str, str]]) -> list[str]:
    """Poll until every query returns a series; the ones still empty at the deadline."""
    pending = dict(queries)
    deadline = time.monotonic() + DEADLINE_SECONDS
    while pending and time.monotonic() < deadline:
        for name, expr in list(pending.items()):
            if prometheus.series(expr):
                del pending[name]
        if pending:
            time.sleep(0.5)  # Prometheus evaluates once a second: poll, with a deadline
    return [f"{name}: {pending[name]}" for name in pending]


def metrics_in(expr: str) -> list[str]:
    return METRIC.findall(LABELS.sub("", expr))


def missing_metrics(prometheus: Prometheus, queries: list[tuple[str, str]]) -> list[str]:
    known = prometheus.metric_names()
    return sorted(
        {
            f"{name}: {metric}"
            for name, expr in queries
            for metric in metrics_in(expr)
            if metric not in known
        }
    )


def all_queries() -> list[tuple[str, str]]:
    return [*dashboard_queries(), *rule_queries(), ("KEDA ScaledObject", keda_query())]


def test_every_dashboard_rule_and_autoscaler_query_returns_series(scraped: Prometheus) -> None:
    queries = all_queries()
    assert len(queries) >= 20
    assert wait_for_series(scraped, queries) == []
    assert missing_metrics(scraped, all_queries()) == []


def test_a_misnamed_metric_is_caught(scraped: Prometheus) -> None:
    """The check above can fail: a panel naming a metric epp does not export is reported."""
    wrong = [("panel 'typo'", "max by (name) (inference_pool_ready_pod)")]
    assert missing_metrics(scraped, wrong) == ["panel 'typo': inference_pool_ready_pod"]
    assert scraped.series(wrong[0][1]) == []


def test_the_epp_down_alert_sees_the_scrape_target(scraped: Prometheus) -> None:
    up = scraped.series('up{job="epp"}')
    assert up
    assert all(s["value"][1] == "1" for s in up)


def test_requests_waiting_for_an_empty_pool_ask_for_a_replica(scraped: Prometheus) -> None:
    """Scale from zero: ``ghost`` has no ready endpoint but receives requests (held by flow
    control, then refused 503), so its desired replicas is at least 1; ``main`` serves the
    load and asks for some."""
    query = "sum by (pool) (epp_pool_desired_replicas)"
    desired: dict[str, float] = {}
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not (desired.get("ghost", 0) >= 1 and desired.get("main", 0) >= 1):
        assert time.monotonic() < deadline, f"desired replicas stayed {desired}"
        time.sleep(0.5)  # poll Prometheus (1 s scrape interval) with a deadline
        desired = {s["metric"]["pool"]: float(s["value"][1]) for s in scraped.series(query)}
    ready = {
        s["metric"]["name"]: s["value"][1] for s in scraped.series("inference_pool_ready_pods")
    }
    assert ready["ghost"] == "0"


def test_flow_control_panels_show_held_and_dropped_requests(scraped: Prometheus) -> None:
    """The ``ghost`` requests waited in the queue and were dropped at the TTL: the drop panel
    names that reason and the wait panel the rejected outcome."""
    drops = "sum by (inference_pool, reason) (epp_flow_control_requests_dropped_total)"
    waits = (
        "sum by (outcome) (inference_extension_flow_control_request_queue_duration_seconds_count)"
    )
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        reasons = {
            (s["metric"]["inference_pool"], s["metric"]["reason"]) for s in scraped.series(drops)
        }
        outcomes = {s["metric"]["outcome"] for s in scraped.series(waits)}
        if ("ghost", "rejected-ttl-expired") in reasons and "rejected" in outcomes:
            break
        assert time.monotonic() < deadline, f"drops {reasons}, wait outcomes {outcomes}"
        time.sleep(0.5)  # poll Prometheus (1 s scrape interval) with a deadline
