"""The canary manifests (deploy/kubernetes/canary) validate against llm-d-router's CRDs
(schema and CEL, tests/helpers/k8s_schema.py), the validation catches mistakes in them, and
epp reads them as the walkthrough in docs/kubernetes.md says."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.discovery.pool_resources import objective_priorities
from epp.rewrite import RewriteTable, Target
from epp.rewrite.kubernetes import Resource, rewrite_rules
from tests.helpers import k8s_schema

CANARY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "canary"


def manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((CANARY / name).read_text()) if d]


def as_resource(obj: dict[str, Any]) -> Resource:
    group = obj["apiVersion"].rpartition("/")[0]
    return Resource(group, "default", obj["metadata"]["name"], "t", obj["spec"])


@pytest.mark.parametrize("name", ["model-rewrite.yaml", "objectives.yaml"])
def test_the_canary_manifests_validate(name: str) -> None:
    for obj in manifests(name):
        assert k8s_schema.validate(obj) == []


def test_epp_reads_the_canary_as_documented() -> None:
    rules, problems = rewrite_rules(map(as_resource, manifests("model-rewrite.yaml")), "vllm-pool")
    assert problems == []
    rule = RewriteTable(rules).rule_for("qwen3-chat")
    assert rule is not None
    assert rule.targets == (Target("qwen3-chat-v1", 90), Target("qwen3-chat-v2", 10))
    priorities, _ = objective_priorities(
        [as_resource(o) for o in manifests("objectives.yaml")], "vllm-pool"
    )
    assert priorities == {"critical": 10, "batch": -1}


def _target(obj: dict[str, Any]) -> dict[str, Any]:
    target: dict[str, Any] = obj["spec"]["rules"][0]["targets"][0]
    return target


EDITS: list[tuple[str, Callable[[dict[str, Any]], object], str]] = [
    ("weight-zero", lambda o: _target(o).update(weight=0), "is less than the minimum of 1"),
    (
        "weight-huge",
        lambda o: _target(o).update(weight=1_000_001),
        "is greater than the maximum of 1000000",
    ),
    (
        "prefix-match",
        lambda o: o["spec"]["rules"][0]["matches"][0]["model"].update(type="Prefix"),
        "is not one of ['Exact']",
    ),
    ("no-pool", lambda o: o["spec"].pop("poolRef"), "'poolRef' is a required property"),
    ("misspelt", lambda o: _target(o).update(modelRewrites="x"), "modelRewrites"),
    ("no-targets", lambda o: o["spec"]["rules"][0].update(targets=[]), "should be non-empty"),
]


@pytest.mark.parametrize(("edit", "expected"), [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_crd_validation_catches(edit: Callable[[dict[str, Any]], object], expected: str) -> None:
    (obj,) = manifests("model-rewrite.yaml")
    broken = copy.deepcopy(obj)
    edit(broken)
    found = k8s_schema.validate(broken)
    assert any(expected in p for p in found), found


def test_objective_validation_catches_a_misspelt_priority() -> None:
    obj = manifests("objectives.yaml")[0]
    obj["spec"]["priorty"] = obj["spec"].pop("priority")
    assert k8s_schema.validate(obj) != []
    obj["spec"]["priority"] = "high"
    del obj["spec"]["priorty"]
    assert any("is not of type 'integer'" in p for p in k8s_schema.validate(obj))
