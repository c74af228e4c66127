"""GPU-resident LoRA adapter slots (vLLM's max_loras), least recently used first out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class LoraSlots:
    """Which adapters are loaded. A batch that uses an adapter not loaded pays a load delay.

    The scheduler already guarantees a batch never needs more than max_loras adapters, so an
    adapter to evict (one not in this batch) always exists.
    """

    max_loras: int
    load_s: float
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    loads: int = 0

    def activate(self, loras: Iterable[str]) -> float:
        """Make the batch's adapters resident; return the load time spent."""
        needed = set(loras)
        cost = 0.0
        for name in sorted(needed):
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            if len(self.resident) >= self.max_loras:
                victim = next(n for n in self.resident if n not in needed)
                del self.resident[victim]
            self.resident[name] = None
            self.loads += 1
            cost += self.load_s
        return cost
