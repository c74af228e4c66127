"""Flow-control demand every epp process of a group shares: cluster-wide bands and fairness.

Every sync tick a process writes its flow-control rows (:meth:`GroupQueues.export
<epp.state.group_queues.GroupQueues.export>`: per pool key, priority band and fairness id, the
requests it holds and its dispatches so far) to its own key ``{p}:queue:<id>`` with a TTL,
reads the other members' keys and hands them to :meth:`GroupQueues.apply
<epp.state.group_queues.GroupQueues.apply>`. A process that dies stops renewing its key and its
demand vanishes with the TTL (its held requests failed with it).

One JSON array per process (``[version, [key, priority, flow, queued, dispatched], ...]``):
fairness ids are free text, so they travel as JSON strings rather than inside hash field names,
and a reader sees one process's rows as one consistent set. The schema version leads the array
as a bare number, which readers of the unversioned encoding (an array of rows only) skip as an
unreadable row; rows are checked on read (:mod:`epp.state.shared.wire`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from epp.state.group_queues import Row
from epp.state.shared import wire


def encode(rows: Sequence[Row]) -> str:
    return json.dumps(
        [wire.VERSION, *([r.key, r.priority, r.flow, r.queued, r.dispatched] for r in rows)],
        separators=(",", ":"),
    )


def decode(raw: bytes | None) -> list[Row]:
    """One member's rows; a missing key is no rows, unreadable rows are skipped (and
    counted), all of them if the framing is unreadable or of a version this release does not
    read."""
    if raw is None:
        return []
    try:
        items = json.loads(raw)
        if not isinstance(items, list):
            raise wire.Malformed(f"flow-control demand must be an array, got {raw!r:.80}")
        if items and not isinstance(items[0], list):
            wire.check_version(items.pop(0))
        # else written before versions existed: rows only
    except ValueError as exc:
        wire.refused("queue", exc)
        return []
    rows = []
    for item in items:
        try:
            rows.append(_row(item))
        except ValueError as exc:
            wire.refused("queue", exc)
    return rows


def _row(item: object) -> Row:
    if not isinstance(item, list) or len(item) < 5:
        raise wire.Malformed(
            f"a row must be [key, priority, flow, queued, dispatched]: {item!r:.80}"
        )
    key, priority, flow, queued, dispatched = item[:5]
    if not isinstance(key, str) or not isinstance(flow, str) or type(priority) is not int:
        raise wire.Malformed(f"a row's key, priority or flow has the wrong type: {item!r:.80}")
    return Row(
        key, priority, flow, wire.count(queued, "queued"), wire.count(dispatched, "dispatched")
    )
