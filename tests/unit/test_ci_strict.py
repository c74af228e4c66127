"""Under CI a skip for missing infrastructure fails; locally it stays a skip."""

from __future__ import annotations

import pytest

INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
markers =
    contract: real vLLM
"""

SKIPPING = """
import pytest

pytest.importorskip("a_module_that_does_not_exist_anywhere")
"""

SKIPPING_TESTS = """
import pytest

@pytest.mark.skipif(True, reason="redis-server not installed")
def test_marked() -> None:
    pass

def test_called() -> None:
    pytest.skip("envoy binary not installed")

@pytest.mark.contract
def test_contract() -> None:
    pytest.skip("real-vLLM contract tier is opt-in")
"""


# A skipif mark skips at setup, so under CI it is a setup error; pytest.skip() a failure.
@pytest.mark.parametrize(("ci", "failed", "errors", "skipped"), [("true", 1, 1, 1), ("", 0, 0, 3)])
def test_skips_fail_under_ci_except_the_contract_tier(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    ci: str,
    failed: int,
    errors: int,
    skipped: int,
) -> None:
    monkeypatch.setenv("CI", ci)
    pytester.makeini(INI)
    pytester.makepyfile(test_infra=SKIPPING_TESTS)
    result = pytester.runpytest_inprocess("-p", "tests.helpers.ci_strict", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=failed, errors=errors, skipped=skipped)
    if failed:
        result.stdout.fnmatch_lines(["*redis-server not installed", "CI is set*"])


def test_a_module_level_importorskip_fails_collection_under_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    pytester.makeini(INI)
    pytester.makepyfile(test_module=SKIPPING)
    result = pytester.runpytest_inprocess("-p", "tests.helpers.ci_strict", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
