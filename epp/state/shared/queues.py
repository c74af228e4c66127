"""Flow-control demand every epp process of a group shares: cluster-wide bands and fairness.

Every sync tick a process writes its flow-control rows (:meth:`GroupQueues.export
<epp.state.group_queues.GroupQueues.export>`: per pool key, priority band and fairness id, the
requests it holds and its dispatches so far) to its own key ``{p}:queue:<id>`` with a TTL,
reads the other members' keys and hands them to :meth:`GroupQueues.apply
<epp.state.group_queues.GroupQueues.apply>`. A process that dies stops renewing its key and its
demand vanishes with the TTL (its held requests failed with it).

One JSON array per process (``[[key, priority, flow, queued, dispatched], ...]``): fairness ids
are free text, so they travel as JSON strings rather than inside hash field names, and a reader
sees one process's rows as one consistent set.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from epp.state.group_queues import Row

log = logging.getLogger(__name__)


def encode(rows: Sequence[Row]) -> str:
    return json.dumps(
        [[r.key, r.priority, r.flow, r.queued, r.dispatched] for r in rows],
        separators=(",", ":"),
    )


def decode(raw: bytes | None) -> list[Row]:
    """One member's rows; a missing key is no rows, unreadable rows are skipped."""
    if raw is None:
        return []
    try:
        items = json.loads(raw)
    except ValueError as exc:
        log.debug("ignoring unreadable flow-control demand: %s", exc)
        return []
    rows = []
    for item in items if isinstance(items, list) else ():
        try:
            key, priority, flow, queued, dispatched = item
            rows.append(Row(str(key), int(priority), str(flow), int(queued), int(dispatched)))
        except (TypeError, ValueError):
            continue
    return rows
