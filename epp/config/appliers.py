"""What applies each reloadable section: a small registry the server fills at start.

A running part registers a callable for the sections (or single keys, ``scrape.interval``) it
applies; a reload runs every callable once, in registration order, with the new
:class:`~epp.config.Config`. :meth:`Appliers.missing` lists the reloadable keys no callable
covers, so a section declared reloadable cannot silently be ignored by a reload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from epp.config.file import reload_policy, reloadable_keys

if TYPE_CHECKING:
    from epp.config.file import Config

Applier = Callable[["Config"], object]


class Appliers:
    """Section or key -> the callables that apply it on a reload."""

    def __init__(self) -> None:
        self._order: list[Applier] = []
        self._covers: dict[str, list[Applier]] = {}

    def register(self, applier: Applier, keys: Iterable[str]) -> None:
        """``applier`` applies ``keys`` (a section name covers every key below it)."""
        for key in keys:
            reload_policy(key)  # a key that does not exist is a mistake in the caller
            self._covers.setdefault(key, []).append(applier)
        if applier not in self._order:
            self._order.append(applier)

    def apply(self, config: Config) -> None:
        for applier in self._order:
            applier(config)

    def missing(self) -> list[str]:
        """Reloadable keys that neither they nor a section above them has an applier for."""
        return [key for key in reloadable_keys() if not self._covered(key)]

    def _covered(self, key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:n]) in self._covers for n in range(1, len(parts) + 1))
