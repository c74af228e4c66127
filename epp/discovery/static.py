"""The endpoint list written in the configuration file, as a source like the others."""

from __future__ import annotations

from epp.discovery.source import Publish
from epp.discovery.spec import StaticSpec


class StaticSource:
    def __init__(self, spec: StaticSpec) -> None:
        self._endpoints = frozenset(spec.endpoints)

    async def run(self, publish: Publish) -> None:
        # A configuration reload that changes the list replaces this source with a new one.
        publish(self._endpoints)
