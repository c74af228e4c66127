"""Typed per-request data that plugins hand each other, and how a plugin declares it.

A plugin that computes something others read (a prompt's block hashes and prefix matches) is a
:class:`~epp.scheduling.framework.Producer` and lists the :class:`DataKey` it writes in
``produces``; a plugin that reads it lists an :class:`Input` in ``consumes``, required or
optional. The profile builder runs producers once per request, before any filter, in dependency
order, and refuses a profile in which a required input has no producer. Filters, scorers and
post-pick hooks only read, so the order a profile lists its plugins cannot change a decision.

A :class:`Derived` key is computed by the framework from other keys after every producer ran:
it is where a rule that combines several producers' data lives (which prefix source wins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from epp.request import LatencyTarget

if TYPE_CHECKING:
    from epp.scheduling.framework import Cycle

T = TypeVar("T")


class DataKey(Generic[T]):
    """Names one kind of per-request data; ``T`` is its type. Compared by identity."""

    __slots__ = ("description",)

    def __init__(self, description: str) -> None:
        self.description = description

    def __repr__(self) -> str:
        return f"DataKey({self.description!r})"


# The request's latency targets, when it has any (set by the router: a trusted caller's
# x-llm-d-slo-ttft-ms / -tpot-ms header, else its objective's, else the latency-target-filter's).
LATENCY_TARGET: DataKey[LatencyTarget] = DataKey("the request's latency targets")


@dataclass(frozen=True, slots=True)
class Input:
    """A plugin reads ``key``; without a producer in the profile it is refused if ``required``,
    else it works without the data (and says how in its docstring)."""

    key: DataKey[Any]
    required: bool = True


@dataclass(frozen=True, slots=True)
class Derived(Generic[T]):
    """``key`` computed from ``sources`` (any one of them is enough) once producers have run."""

    key: DataKey[T]
    sources: tuple[DataKey[Any], ...]
    compute: Callable[[Cycle], T]


_DERIVED: list[Derived[Any]] = []


def derive(rule: Derived[T]) -> Derived[T]:
    """Declare a derived key (at import time, next to the keys it combines)."""
    _DERIVED.append(rule)
    return rule


def derived_rules() -> Sequence[Derived[Any]]:
    return tuple(_DERIVED)


def derived_from(key: DataKey[Any]) -> Derived[Any] | None:
    """The rule that computes ``key``, or None when producers write it directly."""
    return next((rule for rule in _DERIVED if rule.key is key), None)
