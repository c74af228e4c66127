"""Model rewrite: rule precedence, the weighted choice (its shares and its stickiness per
session), the file's ``models.NAME.rewrite`` and the Kubernetes adapter (docs/rewrite.md)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from epp.config import ConfigError, parse_config
from epp.discovery.policy import ClusterPolicy
from epp.discovery.pool_resources import objective_priorities
from epp.generation import Generation
from epp.rewrite import ANY_MODEL, RewriteTable, Rule, Target
from epp.rewrite.kubernetes import GROUP, OLD_GROUP, Resource, rewrite_rules
from epp.rewrite.rules import session_point
from tests.helpers.fake_kube import split

REQUESTS = 2000


def rule(models: tuple[str, ...], *targets: tuple[str, int], origin: str = "r") -> Rule:
    return Rule(models, tuple(Target(m, w) for m, w in targets), origin)


def test_a_90_10_split_lands_within_two_points_of_ten_percent() -> None:
    table = RewriteTable([rule(("chat",), ("v1", 90), ("v2", 10))])
    draw = random.Random(7).random
    counts = Counter(table.choose("chat", None, draw).target for _ in range(REQUESTS))  # type: ignore[union-attr]
    share = counts["v2"] / REQUESTS
    assert abs(share - 0.10) <= 0.02, counts
    assert set(counts) == {"v1", "v2"}


def test_sessions_split_by_weight_and_each_stays_on_one_target() -> None:
    table = RewriteTable([rule(("chat",), ("v1", 90), ("v2", 10))])
    chosen = {}
    for i in range(REQUESTS):
        targets = {table.choose("chat", f"session-{i}").target for _ in range(3)}  # type: ignore[union-attr]
        assert len(targets) == 1  # every request of a session: one target
        chosen[i] = targets.pop()
    share = Counter(chosen.values())["v2"] / REQUESTS
    assert abs(share - 0.10) <= 0.02
    # Shifting weight towards v2 moves sessions one way only: none of v2's goes back to v1.
    wider = RewriteTable([rule(("chat",), ("v1", 50), ("v2", 50))])
    moved = {i for i, t in chosen.items() if wider.choose("chat", f"session-{i}").target != t}  # type: ignore[union-attr]
    assert all(chosen[i] == "v1" for i in moved)
    assert abs(len(moved) / REQUESTS - 0.40) <= 0.03


def test_a_rule_that_is_not_sticky_draws_per_request_within_a_session() -> None:
    config = parse_config(
        {
            "models": {
                "chat": {"rewrite": [{"model": "v1", "weight": 90}, {"model": "v2", "weight": 10}],
                         "rewrite_sticky": False},
                "v1": {"pools": ["p"]},
                "v2": {"pools": ["p"]},
            },
            "pools": {"p": {"endpoints": ["127.0.0.1:8000"]}},
        }
    )  # fmt: skip
    table = Generation.build(config).rewrites
    draw = random.Random(3).random
    picks = [table.choose("chat", "one-session", draw) for _ in range(REQUESTS)]
    counts = Counter(p.target for p in picks if p is not None)
    # One conversation's turns split 90/10 like unrelated requests, and say they were not sticky.
    assert abs(counts["v2"] / REQUESTS - 0.10) <= 0.02, counts
    assert not any(p is not None and p.sticky for p in picks)


def test_the_session_point_is_a_pure_function_of_model_and_key() -> None:
    assert session_point("chat", "abc") == session_point("chat", "abc")
    assert session_point("chat", "abc") != session_point("other", "abc")
    assert 0 <= session_point("chat", "") < 1


def test_an_exact_match_beats_a_match_all_whatever_the_order() -> None:
    table = RewriteTable(
        [
            rule((), ("everything", 1), origin="old match-all"),
            rule(("chat",), ("v1", 1), origin="first exact"),
            rule(("chat",), ("v2", 1), origin="second exact"),
        ]
    )
    chosen = table.choose("chat", "s")
    assert chosen is not None
    assert (chosen.target, chosen.origin) == ("v1", "first exact")
    other = table.choose("anything-a-client-sends", None)
    assert other is not None
    assert other.target == "everything"
    # A match-all's rewrite never puts the client's name in a label.
    assert other.requested == ANY_MODEL
    assert chosen.requested == "chat"
    assert table.accepts("anything")
    assert RewriteTable().accepts("chat") is False


def test_no_rule_no_rewrite() -> None:
    assert RewriteTable([rule(("chat",), ("v1", 1))]).choose("other", None) is None


def test_a_rule_needs_positive_weights() -> None:
    with pytest.raises(ValueError, match="weights >= 1"):
        rule(("chat",), ("v1", 0))
    with pytest.raises(ValueError, match="weights >= 1"):
        Rule(("chat",), (), "empty")


# ---- the file


def config(models: dict[str, Any], **extra: Any) -> Any:
    return parse_config(
        {"models": models, "pools": {"main": {"endpoints": ["127.0.0.1:8001"]}}, **extra}
    )


CANARY = {
    "chat": {"rewrite": [{"model": "chat-v1", "weight": 90}, {"model": "chat-v2", "weight": 10}]},
    "chat-v1": {"pools": ["main"]},
    "chat-v2": {"pools": ["main"], "lora": True},
}


def test_the_files_rewrite_needs_no_pools_and_targets_models_with_pools() -> None:
    parsed = config(CANARY)
    assert parsed.models["chat"].pools == ()
    assert parsed.models["chat"].rewrite == (Target("chat-v1", 90), Target("chat-v2", 10))
    gen = Generation.build(parsed)
    assert "chat" in gen.models
    assert "nope" not in gen.models
    assert gen.rewrites.rule_for("chat") is not None


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ({"chat": {"rewrite": [{"model": "ghost"}]}}, "models.chat.rewrite[0].model: must name"),
        ({"chat": {"rewrite": []}}, "models.chat.rewrite: must list at least one target"),
        (
            {"chat": {"rewrite": [{"model": "m", "weight": 0}]}, "m": {"pools": ["main"]}},
            "models.chat.rewrite[0].weight: must be an integer >= 1",
        ),
        (
            # No chains: a target must be served, not rewritten again.
            {
                "a": {"rewrite": [{"model": "b"}]},
                "b": {"rewrite": [{"model": "c"}]},
                "c": {"pools": ["main"]},
            },
            "models.a.rewrite[0].model: must name a model with pools, got 'b'",
        ),
        ({"chat": {}}, "models.chat.pools: must be set"),
    ],
)
def test_bad_rewrites_are_reported(models: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(models)
    assert any(message in e for e in caught.value.errors), caught.value.errors


# ---- the cluster


def resource(name: str, created: str, *rules: dict[str, Any], group: str = GROUP) -> Resource:
    return Resource(
        group, "default", name, created, {"poolRef": {"name": "pool"}, "rules": list(rules)}
    )


def test_cluster_precedence_exact_then_oldest() -> None:
    newer = resource("newer", "2026-01-02T00:00:00Z", split("chat", ("v2", 1)))
    older = resource(
        "older", "2026-01-01T00:00:00Z", split(None, ("v1", 1)), split("chat", ("v3", 1))
    )
    rules, problems = rewrite_rules([newer, older], "pool")
    assert problems == []
    table = RewriteTable(rules)
    # The older resource's exact rule beats the newer's; its match-all takes the rest.
    assert table.choose("chat", None).origin == "InferenceModelRewrite default/older rules[1]"  # type: ignore[union-attr]
    assert table.choose("other", None).target == "v1"  # type: ignore[union-attr]


def test_cluster_resources_of_another_pool_or_malformed_are_left_out() -> None:
    other = Resource(
        GROUP,
        "default",
        "x",
        "t",
        {"poolRef": {"name": "elsewhere"}, "rules": [split("a", ("b", 1))]},
    )
    mixed = resource(
        "mixed",
        "t",
        {
            "matches": [{"model": {"value": "a"}}],
            "targets": [{"modelRewrite": "b", "weight": 2}, {"modelRewrite": "c"}],
        },
        {
            "matches": [{"model": {"type": "Prefix", "value": "a"}}],
            "targets": [{"modelRewrite": "b"}],
        },
        {"targets": [{"modelRewrite": "b"}, {"modelRewrite": "c"}]},
    )
    rules, problems = rewrite_rules([other, mixed], "pool")
    assert [r.origin for r in rules] == ["InferenceModelRewrite default/mixed rules[2]"]
    # Unweighted targets share equally; the match-all rule matches every model.
    assert rules[0].targets == (Target("b", 1), Target("c", 1))
    assert rules[0].models == ()
    assert len(problems) == 2
    assert "weights must be set on every target or on none" in problems[0]


def test_equally_old_resources_prefer_the_current_group() -> None:
    old = resource("a", "t", split("chat", ("old", 1)), group=OLD_GROUP)
    new = resource("z", "t", split("chat", ("new", 1)))
    rules, _ = rewrite_rules([old, new], "pool")
    assert RewriteTable(rules).choose("chat", None).target == "new"  # type: ignore[union-attr]


def test_the_cluster_wins_over_the_file_and_targets_must_be_served() -> None:
    cluster_rule = rule(("chat",), ("chat-v2", 1), ("unknown", 5), origin="cluster")
    policy = ClusterPolicy(rewrites=(cluster_rule, rule(("extra",), ("unknown", 1))))
    gen = Generation.build(config(CANARY), policy)
    chosen = gen.rewrites.choose("chat", None)
    # The unknown target is left out (the rest keeps its ratio); a rule left with none is out.
    assert chosen is not None
    assert (chosen.target, chosen.origin) == ("chat-v2", "cluster")
    assert "extra" not in gen.models
    assert any("'unknown'" in p for p in gen.problems)
    assert any("models.chat.rewrite: replaced" in p for p in gen.problems)


def test_cluster_objectives_merge_with_the_files_and_win() -> None:
    parsed = config(CANARY, request={"objectives": {"batch": -1, "critical": 5}})
    gen = Generation.build(parsed, ClusterPolicy(objectives={"critical": 10, "chat": 3}))
    assert gen.config.request.objectives == {"batch": -1, "critical": 10, "chat": 3}
    assert gen.problems == (
        "objective 'critical': priority 10 from the cluster overrides 5 from the file",
    )


def test_inference_objectives_read_for_their_pool() -> None:
    def objective(name: str, priority: object, group: str = GROUP, pool: str = "pool") -> Resource:
        spec: dict[str, Any] = {"poolRef": {"name": pool}}
        if priority is not None:
            spec["priority"] = priority
        return Resource(group, "default", name, "t", spec)

    priorities, problems = objective_priorities(
        [
            objective("critical", 10),
            objective("critical", 99, OLD_GROUP),  # the current group's wins
            objective("default", None),  # unset: 0
            objective("other-pool", 3, pool="x"),
            objective("bad", "high"),
        ],
        "pool",
    )
    assert priorities == {"critical": 10, "default": 0}
    assert problems == ["InferenceObjective default/bad: priority must be an integer"]
