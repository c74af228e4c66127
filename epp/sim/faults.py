"""Injected faults of one replica (POST/GET /admin/faults).

``error_rate`` fails an evenly spread share of requests, not a random draw: with 0.5 every second
request fails, with 0.2 every fifth. A test then knows exactly what a replica does while its
fault lasts (at 0.5 it never answers two requests in a row, so a circuit that needs several
successful trials cannot close), whatever the machine's speed does to the order of arrivals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from epp.sim.protocol import APIError

ACTIONS = ("crash", "clear_cache")


@dataclass
class Faults:
    """Standing faults. `crash` and `clear_cache` are one-shot actions, not state."""

    latency_ms: float = 0.0
    error_rate: float = 0.0
    hang: bool = False
    # Requests seen since error_rate was last set: where the evenly spread failures fall.
    seen: int = field(default=0, repr=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["seen"]
        return d

    def update(self, body: dict[str, Any]) -> None:
        """Apply a POST body; validates everything before changing anything.

        Unknown keys are refused: a misspelt fault silently doing nothing would make a test
        pass for the wrong reason.
        """
        unknown = set(body) - {*self.as_dict(), *ACTIONS}
        if unknown:
            raise APIError(400, f"unknown fault keys: {sorted(unknown)}")
        for key in ("hang", *ACTIONS):
            if key in body and not isinstance(body[key], bool):
                raise APIError(400, f"'{key}' must be a boolean", key)
        new = self.as_dict()
        for key in ("latency_ms", "error_rate"):
            if key in body:
                value = body[key]
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise APIError(400, f"'{key}' must be a non-negative number", key)
                new[key] = float(value)
        if new["error_rate"] > 1:
            raise APIError(400, "'error_rate' must be within 0..1", "error_rate")
        if "hang" in body:
            new["hang"] = body["hang"]
        if new["error_rate"] != self.error_rate:
            self.seen = 0
        self.latency_ms, self.error_rate, self.hang = (
            new["latency_ms"],
            new["error_rate"],
            new["hang"],
        )

    def should_fail(self) -> bool:
        """Whether this request fails: the n-th fails when n * rate crosses an integer."""
        n = self.seen
        self.seen += 1
        return int((n + 1) * self.error_rate) > int(n * self.error_rate)
