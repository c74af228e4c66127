"""Under CI, a test that would skip fails instead (a pytest plugin, loaded by tests/conftest.py).

Unit and end-to-end tests skip only when infrastructure is missing on a developer's machine
(redis-server, Envoy, openssl, jinja2, a capture file, an unregistered plugin). On CI that
infrastructure is part of the contract: a skip there would hide a broken image behind a green
run. So when ``CI`` is set (``true``/``1``/``yes``, as GitHub Actions, GitLab and most runners
set it) every skip, whether from ``pytest.skip``, a ``skipif`` mark or ``importorskip``, in a
test or at collection, is reported as a failure carrying the skip's reason.

The contract tier (``tests/contract``, the ``contract`` mark) is exempt: it runs against a real
vLLM only when ``EPP_CONTRACT=1`` says so, and its skips state exactly that.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

CI_VALUES = ("1", "true", "yes")


def strict() -> bool:
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


def _reason(longrepr: Any) -> str:
    # A skip's longrepr is (path, line, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"{_reason(report.longrepr)}\n"
        "CI is set: missing infrastructure fails the test instead of skipping it "
        "(tests/helpers/ci_strict.py). Install what the reason names, or unset CI locally."
    )


def _exempt(nodeid: str) -> bool:
    return nodeid.startswith("tests/contract")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if (
        report.skipped
        and strict()
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("contract") is None
        and not _exempt(item.nodeid)
    ):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and strict() and not _exempt(report.nodeid):
        _fail(report)
