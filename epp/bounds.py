"""The range a number must lie in, shared by configuration keys and plugin parameters."""

from __future__ import annotations

from dataclasses import dataclass


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range a number must be in (None: unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self) -> str:
        """`` >= 1``, `` in (0, 1]``, or "" when unbounded."""
        low = high = ""
        if self.ge is not None or self.gt is not None:
            low = f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt or 0)}"
        if self.le is not None or self.lt is not None:
            high = f"{_number(self.le)}]" if self.le is not None else f"{_number(self.lt or 0)})"
        if low and high:
            return f" in {low}, {high}"
        for sign, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)):
            if bound is not None:
                return f" {sign} {_number(bound)}"
        return ""
