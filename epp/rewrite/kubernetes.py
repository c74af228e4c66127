"""The Kubernetes source adapter: ``InferenceModelRewrite`` objects as :class:`Rule` objects.

Read from ``llm-d.ai/v1alpha2`` and, for clusters migrating from it, the older
``inference.networking.x-k8s.io/v1alpha2`` (the same schema; epp only reads either). A resource
applies to the pool its ``spec.poolRef`` names (kind InferencePool, whatever its group).
Resources are taken oldest first (``metadata.creationTimestamp``; on a tie the current group,
then namespace and name), each one's ``spec.rules`` in order, so that
:class:`~epp.rewrite.RewriteTable`'s "first exact rule, else first match-all rule" is llm-d's
precedence: an Exact match beats an empty ``matches``, then the oldest resource wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from epp.rewrite.rules import Rule, Target

GROUP = "llm-d.ai"
OLD_GROUP = "inference.networking.x-k8s.io"
VERSION = "v1alpha2"
# Read in this order of preference when two resources are equally old.
GROUPS = (GROUP, OLD_GROUP)


@dataclass(frozen=True, slots=True)
class Resource:
    """One custom resource as the adapters read it."""

    group: str
    namespace: str
    name: str
    # RFC 3339 UTC (the API's format): compares like the times it names.
    created: str
    spec: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"

    def for_pool(self, pool: str) -> bool:
        """Whether ``spec.poolRef`` names the InferencePool ``pool`` (kind defaults to it)."""
        ref = self.spec.get("poolRef")
        if not isinstance(ref, Mapping):
            return False
        return ref.get("name") == pool and ref.get("kind", "InferencePool") == "InferencePool"


def oldest_first(resources: Iterable[Resource]) -> list[Resource]:
    rank = {g: i for i, g in enumerate(GROUPS)}
    return sorted(
        resources, key=lambda r: (r.created, rank.get(r.group, len(rank)), r.namespace, r.name)
    )


def rewrite_rules(resources: Iterable[Resource], pool: str) -> tuple[list[Rule], list[str]]:
    """The rules of the resources for ``pool`` in precedence order, and a message for each
    rule that cannot be used (it is left out; the others apply)."""
    rules: list[Rule] = []
    problems: list[str] = []
    for resource in oldest_first(r for r in resources if r.for_pool(pool)):
        listed = resource.spec.get("rules")
        for index, raw in enumerate(listed if isinstance(listed, list) else ()):
            origin = f"InferenceModelRewrite {resource.label} rules[{index}]"
            try:
                rules.append(_rule(raw, origin))
            except ValueError as exc:
                problems.append(f"{origin}: {exc}; rule ignored")
    return rules, problems


def _rule(raw: Any, origin: str) -> Rule:
    if not isinstance(raw, Mapping):
        raise ValueError("not an object")
    models: list[str] = []
    for match in raw.get("matches") or ():
        model = match.get("model") if isinstance(match, Mapping) else None
        if not isinstance(model, Mapping) or not isinstance(model.get("value"), str):
            raise ValueError("a match needs model.value")
        if model.get("type", "Exact") != "Exact":
            raise ValueError(f"match type {model.get('type')!r} is not supported (only Exact)")
        models.append(model["value"])
    targets = [t for t in raw.get("targets") or () if isinstance(t, Mapping)]
    if not targets or not all(isinstance(t.get("modelRewrite"), str) for t in targets):
        raise ValueError("needs targets, each with a modelRewrite")
    weights = [t.get("weight") for t in targets]
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise ValueError("weights must be set on every target or on none")
    if any(w is not None and (not isinstance(w, int) or w < 1) for w in weights):
        raise ValueError("weights must be integers >= 1")
    return Rule(
        tuple(models),
        tuple(Target(t["modelRewrite"], t.get("weight") or 1) for t in targets),
        origin,
    )
