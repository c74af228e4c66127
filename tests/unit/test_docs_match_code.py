"""Figures the docs state about the code, read from both and compared, so neither drifts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from epp.config import parse_config
from epp.envoy_config import ext_proc_settings, render

ROOT = Path(__file__).resolve().parents[2]


def _ext_proc_retry_policy() -> dict[str, Any]:
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8000"]}},
        }
    )
    boot = yaml.safe_load(render(config))
    (ext_proc,) = ext_proc_settings(boot)
    policy: dict[str, Any] = ext_proc["grpc_service"]["retry_policy"]
    return policy


def _ms(duration: str) -> int:
    return round(float(duration.removesuffix("s")) * 1000)


def test_envoy_readme_states_the_rendered_ext_proc_retry_policy() -> None:
    policy = _ext_proc_retry_policy()
    readme = (ROOT / "envoy" / "README.md").read_text()
    bullet = re.search(
        r"`grpc_service\.retry_policy` \(([^;]+); (\d+) retries\s+backing off (\d+) -> (\d+) ms",
        readme,
    )
    assert bullet is not None, "envoy/README.md no longer describes grpc_service.retry_policy"
    conditions, retries, base, most = bullet.groups()
    assert int(retries) == policy["num_retries"]
    backoff = policy["retry_back_off"]
    assert (int(base), int(most)) == (_ms(backoff["base_interval"]), _ms(backoff["max_interval"]))
    assert {c.strip() for c in conditions.split(",")} == set(policy["retry_on"].split(","))
    # The operations section repeats the figures.
    assert f"retried up to {policy['num_retries']} times, backing off {base} -> {most} ms" in (
        " ".join(readme.split())
    )


DOCS = [ROOT / "README.md", ROOT / "envoy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _cited_paths(doc: Path) -> list[str]:
    """Relative links, repository paths in backticks and bare FILE.md names a document cites."""
    text = doc.read_text()
    cited = [
        str((doc.parent / m.group(1)).relative_to(ROOT))
        for m in re.finditer(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", text)
    ]
    cited += re.findall(r"`((?:epp|tests|docs|envoy|benchmarks|tools|protos)/[\w./-]+)`", text)
    cited += [
        str(p.relative_to(ROOT))
        for name in re.findall(r"\b([A-Z][A-Za-z_-]*\.md)\b", text)
        for p in [next(ROOT.rglob(name), ROOT / name)]
    ]
    return cited


def test_documents_cite_only_files_that_exist() -> None:
    assert len(DOCS) > 5
    missing = [
        f"{doc.relative_to(ROOT)} cites {path}"
        for doc in DOCS
        for path in _cited_paths(doc)
        if not (ROOT / path).exists()
    ]
    assert missing == []
    # The walk finds citations at all (or it would pass on anything).
    assert "epp/state/shared/lease.py" in _cited_paths(ROOT / "docs" / "active-active.md")
