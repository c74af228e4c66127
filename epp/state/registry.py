"""Long-lived state a plugin declares, kept in the fleet state across configuration reloads.

A plugin that learns across requests names its state with a :class:`StateKey` (like the typed
per-request :class:`~epp.scheduling.data.DataKey`): the factory that builds it, the parameters
that give its entries their meaning, whether what a pick recorded in it moves when a retry ends
on another endpoint, and whether it replicates through Redis. :class:`States` holds one
instance per key; two keys of one name with different parameters are two instances, so entries
learned under one parameter set never meet lookups made under another.

- Moving (``moves=True``): the state has a ``journal`` attribute (:class:`Journaled`). While a
  pick's post-pick hooks run, :class:`~epp.state.moves.Recording` points it at a list; the state
  appends a :class:`Footprint` for each entry it records, and
  :func:`~epp.state.moves.move_pick` asks each footprint of the picked endpoint to move itself.
- Replicating (``replicated`` set): the state has ``take_recent``, ``recent_count`` and
  ``apply`` (:class:`~epp.state.shared.picks.Replicated`); the pick stream ships its additions
  under the key's :attr:`StateKey.tag` and applies other processes' items of that tag to it. A
  process applies only tags of states it keeps, so items of a parameter set it does not use are
  skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Footprint(Protocol):
    """One entry a pick recorded for ``endpoint``; ``move`` records it for ``served`` instead
    as of wall time ``now`` (while a :class:`~epp.state.moves.Recording` is open, so that the
    moved entry is noted)."""

    @property
    def endpoint(self) -> str: ...

    def move(self, served: str, now: float) -> None: ...


class Journaled(Protocol):
    """A state whose recorded entries can move: it notes a :class:`Footprint` in ``journal``
    for each entry it records while ``journal`` is not None (typed ``Any``: the states'
    packages do not import this one, their footprints match :class:`Footprint` by shape)."""

    journal: list[Any] | None


def _as_is(item: Any, _now: float) -> Any:
    return item


@dataclass(frozen=True, slots=True)
class Replication:
    """How a state's items travel through the pick stream.

    ``item`` is the NamedTuple shipped (each field checked by
    :func:`epp.state.shared.wire.record`); ``check`` takes one whose field types are right and
    the wall time now, and returns it within the state's bounds or raises
    :class:`epp.state.shared.wire.Malformed`.
    """

    item: type
    check: Callable[[Any, float], Any] = _as_is


@dataclass(frozen=True, slots=True)
class StateKey(Generic[T]):
    """Names one long-lived state: equal ``name`` and ``params`` mean the same instance.

    ``tag`` is its channel in the pick stream when it replicates; by default the name followed
    by each parameter, so processes configured differently never apply each other's items.
    """

    name: str
    factory: Callable[[], T] = field(compare=False)
    params: tuple[int | str, ...] = ()
    moves: bool = field(default=False, compare=False)
    replicated: Replication | None = field(default=None, compare=False)
    tag: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.tag:
            object.__setattr__(self, "tag", ":".join([self.name, *map(str, self.params)]))


class States:
    """One instance per declared :class:`StateKey`, created on first use and kept for the
    process's life (reloads rebuild plugins, not this)."""

    def __init__(self) -> None:
        self._states: dict[StateKey[Any], Any] = {}
        # The journaled states (looked up after every pick: kept ready).
        self.journaled: list[Journaled] = []

    def get(self, key: StateKey[T]) -> T:
        """``key``'s state, built by its factory the first time."""
        try:
            state: T = self._states[key]
        except KeyError:
            state = self._states[key] = key.factory()
            if key.moves:
                self.journaled.append(state)  # type: ignore[arg-type]
        return state

    def named(self, name: str) -> list[Any]:
        """Every instance of the states called ``name`` (one per parameter set in use)."""
        return [s for k, s in self._states.items() if k.name == name]

    def replicated(self) -> Iterator[tuple[str, Replication, Any]]:
        """The states that replicate through Redis: tag, replication and state."""
        for key, state in self._states.items():
            if key.replicated is not None:
                yield key.tag, key.replicated, state
