"""The documents are for users: docs/ holds documents only, none names where or by whom it was
written (an issue, a branch, a developer's path, a working session), and the facts they state
about Redis keys and generated reports match the code.

Benchmark results and the logs of earlier runs live under benchmarks/results/, which these
rules do not cover.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from epp.state.redis_store import RedisStore
from epp.state.shared.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "envoy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What a document must not name. Upstream projects' numbered issues and pull requests
# ("vLLM issue #40004", "PRs #45561") are facts about other projects and stay allowed.
FORBIDDEN = {
    "an issue of this project": re.compile(r"\b[Ii]ssues? \d+\b|(?<![\w/&#])#\d{1,3}\b"),
    "a branch": re.compile(r"\b[Bb]ranch(?:es)?\b|\bunmerged\b|\bnot merged\b"),
    "a developer's path": re.compile(r"(?<![\w.~-])/(?:work|home|root|Users)/"),
    "a working session": re.compile(
        r"\b(?:this|that|the previous|an earlier|one|other) sessions?\b(?!-)"
        r"|(?<![/\w])helpers?\b(?![/.])"
    ),
}


def _offences(text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if match := pattern.search(line):
                found.append(f"line {n} names {what}: {match[0]!r}")
    return found


def test_docs_holds_documents_only() -> None:
    """Result dumps (JSON, CSV, logs) belong in benchmarks/results/, not beside the documents."""
    others = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "docs").rglob("*")
        if p.is_file() and p.suffix not in {".md", ".png", ".svg"}
    ]
    assert others == []
    assert list((ROOT / "benchmarks" / "results").glob("*.json")), "the results moved there"


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_document_names_no_issue_branch_path_or_session(doc: Path) -> None:
    assert _offences(doc.read_text()) == []


@pytest.mark.parametrize(
    "line",
    [
        "Until issue 16 epp forgot a request",
        "fixed in #18",
        "Branch h-overload (`admission.pool_reserve`)",
        "the seventh pass (not merged)",
        "`--before /work/wt/hp-base`",
        "all of this session's work merged",
        "2 cores shared with other sessions; load average 1.4",
        "while the other helpers' benchmarks ran",
    ],
)
def test_the_check_catches(line: str) -> None:
    assert _offences(line) != []


@pytest.mark.parametrize(
    "line",
    [
        "vLLM issue #40004; the waiting loop",
        "vllm PRs #45561/#54530 open",
        "`--workdir /tmp/trace`",
        "session-affinity-scorer: sticky sessions with a TTL",
        "a fake API server (`tests/helpers/fake_kube.py`)",
        "[the plugin contract](scheduling.md#the-plugin-contract)",
    ],
)
def test_the_check_lets_through(line: str) -> None:
    assert _offences(line) == []


def test_the_key_table_lists_every_redis_key() -> None:
    """docs/active-active.md's key schema names every key the code writes."""
    text = (ROOT / "docs" / "active-active.md").read_text()
    table = set(re.findall(r"^\| `(\{p\}:[^`]+)` \|", text, re.M))
    keys = Keys("{p}")
    placeholders = {"address": "<host:port>", "member": "<process id>"}
    placeholders |= {"kind": "<kind>", "tenant": "<tenant>"}
    expected = set()
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            expected.add(getattr(keys, name))
        elif callable(member):
            params = list(inspect.signature(member).parameters)[1:]
            expected.add(getattr(keys, name)(*(placeholders[p] for p in params)))
    # The endpoint state key is RedisStore's own.
    assert ":ep:" in inspect.getsource(RedisStore._key)
    expected.add("{p}:ep:<host:port>")
    assert len(expected) >= 8
    assert table == expected


def test_benchmarks_write_only_generated_pages_into_docs() -> None:
    """A benchmark that writes a page of docs/ by default writes a wholly generated one (its
    first lines name the command that made it); a hand-written page is never its target, so
    such a benchmark writes under benchmarks/results/ instead."""
    targets = {
        (script.stem, match[1])
        for script in (ROOT / "benchmarks").glob("*.py")
        for match in re.finditer(r'ROOT / "docs" / "([\w-]+\.md)"', script.read_text())
    }
    assert len(targets) >= 5, targets  # the search finds them at all
    for script, page in sorted(targets):
        head = "\n".join((ROOT / "docs" / page).read_text().splitlines()[:5])
        assert f"-m benchmarks.{script}" in head, f"benchmarks/{script}.py writes docs/{page}"
    for script in ("overhead", "learned", "overload"):
        assert (script, f"{script}.md") not in targets
