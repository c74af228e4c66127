"""What an item replayed from another process may hold, beyond the types of its fields.

The pick stream (:mod:`epp.state.shared.picks`) checks each item's field types; these add the
bounds one table needs, so a forged or corrupt item cannot pin state for ever or blow up the
table that applies it. Each takes the item and the wall time it arrives, and returns the item
to apply (timestamps clamped) or raises :class:`~epp.state.shared.wire.Malformed`.
"""

from __future__ import annotations

from collections.abc import Callable

from epp.state.health import HealthTracker, Verdict
from epp.state.shared import wire
from epp.state.shared.sessions import Binding

# A session binding expires at most this far ahead, whatever it says (session TTLs are minutes).
BINDING_HORIZON = 86_400.0
# Ejections in a row a verdict may count: an ejection lasts base * 2**(n-1) seconds (capped),
# and an exponent far past any real streak would overflow that computation.
MAX_EJECTIONS = 64


def verdicts(health: HealthTracker) -> Callable[[Verdict, float], Verdict]:
    """No shared ejection lasts longer than ``health``'s configured maximum from now."""

    def check(verdict: Verdict, now: float) -> Verdict:
        if not 0 <= verdict.ejections <= MAX_EJECTIONS:
            raise wire.Malformed(f"a verdict counting {verdict.ejections} ejections")
        latest = now + health.config.max_ejection_seconds
        return verdict._replace(until=wire.clamp("picks", verdict.until, latest))

    return check


def binding(item: Binding, now: float) -> Binding:
    return item._replace(expires_at=wire.clamp("picks", item.expires_at, now + BINDING_HORIZON))
