"""Rules, their precedence and the weighted choice of a target.

A :class:`Rule` matches model names exactly (or, with no names, every model) and lists
weighted targets; a target's share is its weight over the sum of the rule's weights. The
:class:`RewriteTable` holds the rules in precedence order and answers, per request, which rule
applies: the first rule naming the model exactly, else the first rule matching every model (an
exact match beats a match-all whatever their order).

The choice is sticky when the request has a session key: a hash of the model and the key is a
point in the rule's cumulative weights, so every request of a conversation lands on the same
target while the weights hold, and when they change only the sessions whose point changed
ranges move (moving weight from the first target to the last moves sessions one way only).
Without a key, or under a rule that is not ``sticky``, each request draws at random. Neither
keeps any state per client value.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The ``model_name`` label of requests a match-all rule rewrote: the name the client sent is
# theirs to choose, so it never becomes a label value.
ANY_MODEL = "*"
_HASH_SPACE = float(1 << 64)


@dataclass(frozen=True, slots=True)
class Target:
    """A model the rule sends a share of its requests to (a model of the configuration)."""

    model: str
    weight: int = 1


@dataclass(frozen=True, slots=True)
class Rule:
    """Model names matched exactly (empty: every model) and the weighted targets."""

    models: tuple[str, ...]
    targets: tuple[Target, ...]
    # Where the rule comes from, for explanations ("models.chat.rewrite",
    # "InferenceModelRewrite default/canary rules[0]").
    origin: str
    # Place a request by its session key (False: every request draws, session or not).
    sticky: bool = True

    def __post_init__(self) -> None:
        if not self.targets or any(t.weight < 1 for t in self.targets):
            raise ValueError(f"{self.origin}: a rule needs targets with weights >= 1")

    def pick(self, point: float) -> Target:
        """The target at ``point`` in [0, 1) of the cumulative weights."""
        mark = point * sum(t.weight for t in self.targets)
        for target in self.targets:
            mark -= target.weight
            if mark < 0:
                return target
        return self.targets[-1]


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What a rule did to one request."""

    # The requested model as a metric label: the matched name, or ANY_MODEL.
    requested: str
    target: str
    origin: str
    # Chosen from the session key (the same target for every request of the session).
    sticky: bool

    def explain(self) -> dict[str, Any]:
        return {
            "model": self.requested,
            "target": self.target,
            "rule": self.origin,
            "sticky": self.sticky,
        }


def explained(scores: Mapping[str, Any], rewrite: Rewrite | None) -> Mapping[str, Any]:
    """The explain header's content: the candidates' scores (keyed by endpoint), and under
    ``rewrite`` the rewrite that applied, if any."""
    return scores if rewrite is None else {**scores, "rewrite": rewrite.explain()}


class RewriteTable:
    """Rules in precedence order; answers which rule applies to a model and its target."""

    def __init__(self, rules: Sequence[Rule] = ()) -> None:
        self.rules = tuple(rules)
        self._exact: dict[str, Rule] = {}
        for rule in self.rules:
            for model in rule.models:
                self._exact.setdefault(model, rule)
        self._any = next((r for r in self.rules if not r.models), None)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def rule_for(self, model: str) -> Rule | None:
        """The rule that applies to ``model``: the first exact one, else the first match-all."""
        return self._exact.get(model, self._any)

    def accepts(self, model: str) -> bool:
        return model in self._exact or self._any is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The model names rules match exactly."""
        return tuple(self._exact)

    def choose(
        self, model: str, session: str | None, draw: Callable[[], float] = random.random
    ) -> Rewrite | None:
        """The rewrite of a request for ``model`` (None: no rule applies)."""
        rule = self.rule_for(model)
        if rule is None:
            return None
        sticky = session is not None and rule.sticky
        point = session_point(model, session) if sticky and session is not None else draw()
        target = rule.pick(point)
        requested = model if rule.models else ANY_MODEL
        return Rewrite(requested, target.model, rule.origin, sticky)


def session_point(model: str, session: str) -> float:
    """Where in [0, 1) a session's requests for ``model`` fall: the same for every epp."""
    digest = hashlib.blake2b(f"{model}\0{session}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _HASH_SPACE


class AcceptedModels(Collection[str]):
    """The model names a request may send: the configured models and the names a rule
    rewrites (every name, with a match-all rule). What the parser checks ``model`` against;
    iterating lists the named ones (for a 404's message)."""

    def __init__(self, models: Mapping[str, object], table: RewriteTable) -> None:
        self._models = models
        self._table = table

    def __contains__(self, model: object) -> bool:
        return isinstance(model, str) and (model in self._models or self._table.accepts(model))

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._models, *self._table.names]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*self._models, *self._table.names]))


def usable(rules: Sequence[Rule], served: Collection[str]) -> tuple[list[Rule], list[str]]:
    """``rules`` with only the targets epp can route (``served``: models with pools), and a
    message for each target left out. A rule left without targets is left out: the request
    keeps its model. Shares among the remaining targets keep their ratios."""
    kept: list[Rule] = []
    problems: list[str] = []
    for rule in rules:
        targets = tuple(t for t in rule.targets if t.model in served)
        for target in rule.targets:
            if target.model not in served:
                problems.append(
                    f"{rule.origin}: target {target.model!r} is no model of the configuration "
                    "with pools; left out"
                )
        if targets:
            kept.append(Rule(rule.models, targets, rule.origin, rule.sticky))
    return kept, problems
