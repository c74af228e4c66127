"""``epp check-config FILE``: the real CLI, one bad file per validation rule.

Each file breaks one rule and must print that rule's key path; a file with three problems lists
all three; exit status 0 for a valid file, 1 for a bad one. ``epp serve`` refuses the same files
with the same lines (it validates with the same code).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "models": {"m": {"pools": ["p"]}},
    "pools": {"p": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
}
PICKER = {"plugin": "max-score-picker"}


def profile(*entries: dict[str, Any], **scheduling: Any) -> dict[str, Any]:
    return {**BASE, "scheduling": {"profile": "p", "profiles": {"p": list(entries)}, **scheduling}}


def check(tmp_path: Path, data: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "epp.yaml"
    path.write_text(yaml.safe_dump(data))
    return subprocess.run(
        [sys.executable, "-m", "epp", "check-config", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )


RULES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "negative weight": (
        profile({"plugin": "queue-scorer", "weight": -1}, PICKER),
        ["scheduling.profiles.p[0].weight: must be a number >= 0, got -1"],
    ),
    "weight on a filter": (
        profile({"plugin": "lora-filter", "weight": 2}, PICKER),
        ["scheduling.profiles.p[0].weight: must not be set: 'lora-filter' is a filter"],
    ),
    "weight on a picker": (
        profile({"plugin": "queue-scorer"}, {"plugin": "max-score-picker", "weight": 1}),
        ["scheduling.profiles.p[1].weight: must not be set: 'max-score-picker' is a picker"],
    ),
    "port 70000": (
        {**BASE, "server": {"extproc_port": 70000}},
        ["server.extproc_port: must be an integer in [1, 65535], got 70000"],
    ),
    "three servers on one port": (
        {**BASE, "server": {"extproc_port": 9100, "health_port": 9100, "metrics_port": 9100}},
        [
            "server.health_port: must differ from server.extproc_port, both 9100",
            "server.metrics_port: must differ from server.extproc_port, both 9100",
        ],
    ),
    "tokens_per_request 1.5": (
        profile(
            {"plugin": "t", "weight": 2},
            PICKER,
            plugins=[
                {"name": "t", "type": "ttft-scorer", "parameters": {"tokens_per_request": 1.5}}
            ],
        ),
        ["scheduling.plugins[0].parameters.tokens_per_request: must be an integer >= 1, got 1.5"],
    ),
    "unselected profile naming an unknown plugin": (
        {
            **BASE,
            "scheduling": {
                "profile": "p",
                "profiles": {"p": [PICKER], "spare": [{"plugin": "nope"}, PICKER]},
            },
        },
        ["scheduling.profiles.spare[0].plugin: must be a plugin type, got 'nope'"],
    ),
    "consumer without producer": (
        profile({"plugin": "kv-headroom-filter"}, {"plugin": "queue-scorer"}, PICKER),
        [
            "scheduling.profiles.p[0]: must come with a producer of cached prompt tokens per "
            "endpoint: filter 'kv-headroom-filter' (kv-headroom-filter) needs it; add "
            "'precise-prefix-cache-scorer' or 'prefix-cache-scorer' to the profile"
        ],
    ),
    "fallbacks -1": (
        {**BASE, "routing": {"fallbacks": -1}},
        ["routing.fallbacks: must be an integer >= 0, got -1"],
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_prints_its_key_path_and_exits_1(tmp_path: Path, rule: str) -> None:
    data, expected = RULES[rule]
    result = check(tmp_path, data)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(expected), lines
    for line, want in zip(lines, expected, strict=True):
        assert line.startswith(f"{tmp_path / 'epp.yaml'}: {want}"), line


def test_a_file_with_three_errors_lists_all_three(tmp_path: Path) -> None:
    data = profile(
        {"plugin": "lora-filter", "weight": 1},
        {"plugin": "queue-scorer", "weight": -2},
        PICKER,
    )
    data["routing"] = {"fallbacks": -1}
    result = check(tmp_path, data)
    assert result.returncode == 1
    assert [line.split(": ", 2)[1] for line in result.stdout.splitlines()] == [
        "scheduling.profiles.p[0].weight",
        "scheduling.profiles.p[1].weight",
        "routing.fallbacks",
    ]
    assert "3 errors" in result.stderr


def readme_example(tmp_path: Path) -> Path:
    """The configuration reference (docs/configuration.md), as a file."""
    block = (
        (ROOT / "docs" / "configuration.md").read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    )
    path = tmp_path / "readme.yaml"
    path.write_text(block)
    return path


def test_valid_files_exit_0(tmp_path: Path) -> None:
    for path in (ROOT / "envoy" / "example-epp.yaml", readme_example(tmp_path)):
        result = subprocess.run(
            [sys.executable, "-m", "epp", "check-config", str(path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip() == f"{path}: valid"


def test_serve_refuses_the_same_file_with_the_same_lines(tmp_path: Path) -> None:
    data, expected = RULES["three servers on one port"]
    checked = check(tmp_path, data)
    served = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--config", str(tmp_path / "epp.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert served.returncode == 2
    refused = [
        line.removeprefix("epp: invalid configuration: ") for line in served.stderr.splitlines()
    ]
    assert checked.stdout.splitlines() == refused[: len(expected)]
