"""The versioned framing of every payload epp writes to Redis, and how a reader checks it.

Redis is shared by processes of different releases during a rolling upgrade, and anything that
can write to it can write garbage. So every payload carries a schema version and every reader
checks what it reads: an entry it cannot use (unreadable, wrong types, a version it does not
know) is skipped, counted in ``epp_shared_state_rejected_total{kind,reason}`` and logged at most
once per kind and reason per :data:`LOG_INTERVAL`; it never raises into a sync loop and never
changes routing. A timestamp later than it can honestly be (another process's clock runs a
little ahead, or a writer lies) is clamped, so a future-dated entry cannot win every
comparison forever.

Compatibility rule: a release writes :data:`VERSION` and reads :data:`VERSION` and the version
before it. Version 0 is the unversioned encoding of the releases before versions existed; each
versioned payload puts its marker where a version-0 reader ignores it (an extra element, an
extra key, a field it skips as unreadable), so version-0 and version-1 processes understand each
other in both directions. Additive changes (a new trailing field, a new key) keep the version:
readers ignore what they do not know. An incompatible change takes a new version, introduced in
two steps: one release reads it but still writes the old one, the next writes it.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from redis.exceptions import ResponseError

from epp.observability import SHARED_REJECTED

log = logging.getLogger(__name__)

VERSION: Final = 1
# Versions this release reads: its own and the one before (0: the unversioned encoding).
READABLE: Final = frozenset({VERSION - 1, VERSION})

# The payload kinds and the reasons an entry is refused: the metric's whole label set.
KINDS: Final = ("endpoint", "picks", "load", "queue", "latency", "budget", "members")
MALFORMED: Final = "malformed"  # unreadable bytes, wrong shape or types
UNKNOWN_VERSION: Final = "version"  # a version this release does not read
FUTURE: Final = "future"  # a timestamp later than possible (clamped, the entry is kept)
REASONS: Final = (MALFORMED, UNKNOWN_VERSION, FUTURE)

# Hashes (one field per endpoint) carry their version in this field; no address is this.
HASH_VERSION: Final = "_v"
# Clocks of one group's hosts disagree by milliseconds (NTP): a stamp up to this far past its
# bound is taken as it is (processes must agree on it), one further is clamped here and counted.
SKEW: Final = 1.0
# A refused kind and reason is logged at most once per this many seconds (they are counted
# always): a hostile or broken writer must not flood the log.
LOG_INTERVAL: Final = 60.0

_logged: dict[tuple[str, str], float] = {}


class Malformed(ValueError):
    """An entry a reader cannot use; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, message: str, reason: str = MALFORMED) -> None:
        super().__init__(message)
        self.reason = reason


def reject(kind: str, reason: str, detail: object, count: int = 1) -> None:
    """Count ``count`` refused entries of ``kind``; log the first of each interval."""
    SHARED_REJECTED.labels(kind, reason).inc(count)
    now = time.monotonic()
    last = _logged.get((kind, reason))
    if last is None or now - last >= LOG_INTERVAL:
        _logged[(kind, reason)] = now
        log.warning(
            "ignoring %s shared-state entries from redis (%s): %s; counted in "
            "epp_shared_state_rejected_total, logged once a minute",
            kind,
            reason,
            detail,
        )


def refused(kind: str, exc: Exception) -> None:
    """Count and log an entry whose decoding raised ``exc``."""
    reject(kind, exc.reason if isinstance(exc, Malformed) else MALFORMED, exc)


def check_version(version: object) -> None:
    if type(version) is not int or version not in READABLE:
        raise Malformed(
            f"schema version {version!r}, this release reads {sorted(READABLE)}", UNKNOWN_VERSION
        )


def clamp(kind: str, stamp: float, latest: float) -> float:
    """``stamp``, at most ``latest`` plus :data:`SKEW` (counted when beyond)."""
    bound = latest + SKEW
    if stamp > bound:
        reject(kind, FUTURE, f"timestamp {stamp:.3f} is {stamp - latest:.0f} s past its bound")
        return bound
    return stamp


def stamp_hash(fields: Mapping[Any, Any]) -> dict[Any, Any]:
    """A per-endpoint hash's fields with the version field added (version-0 readers skip it:
    its value does not parse as theirs)."""
    return {**fields, HASH_VERSION: str(VERSION)}


def open_hash(kind: str, fields: Mapping[bytes, bytes]) -> Mapping[bytes, bytes]:
    """A hash read from Redis without its version field; empty if its version is not read."""
    raw = fields.get(HASH_VERSION.encode())
    if raw is None:
        return fields
    try:
        check_version(int(raw))
    except ValueError as exc:  # not a number, or one this release does not read
        reject(kind, UNKNOWN_VERSION, exc)
        return {}
    return {k: v for k, v in fields.items() if k != HASH_VERSION.encode()}


def number(value: object, what: str = "number") -> float:
    """A finite int or float (never a bool)."""
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise Malformed(f"{what} must be a finite number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def count(value: object, what: str = "count") -> int:
    """A non-negative int."""
    if type(value) is not int or value < 0:
        raise Malformed(f"{what} must be an integer >= 0, got {value!r}")
    return value


Check = Callable[[object, str], Any]


def typed(hint: Any, value: object, what: str) -> Any:
    """``value`` checked against a field's type hint (see :func:`checker`)."""
    return checker(hint)(value, what)


@functools.cache
def checker(hint: Any) -> Check:
    """The check of a field of type ``hint`` (str, int, float, bool, ``X | None``, sequences
    and sets of those): takes a decoded value and a name for errors, returns the value to store
    (sets and sequences rebuilt) or raises :class:`Malformed`. Built once per type: readers
    check every item of every entry."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        (inner,) = [checker(a) for a in args if a is not type(None)]
        optional = type(None) in args
        return lambda value, what: None if value is None and optional else inner(value, what)
    if hint is float:
        return number
    if hint in (int, str, bool):
        return functools.partial(_exactly, hint)
    if origin is not None and issubclass(origin, Sequence | frozenset | set):
        (item,) = typing.get_args(hint)
        build: Callable[[Any], Any] = frozenset if issubclass(origin, frozenset | set) else list
        if item in (int, str):  # block hashes, adapter names: one pass in C
            allowed = {item}

            def plain(value: object, what: str) -> Any:
                if not isinstance(value, list | tuple) or not set(map(type, value)) <= allowed:
                    raise Malformed(f"{what} must be a list of {item.__name__}")
                return build(value)

            return plain
        each = checker(item)

        def nested(value: object, what: str) -> Any:
            if not isinstance(value, list | tuple):
                raise Malformed(f"{what} must be a list, got {type(value).__name__}")
            return build(each(v, what) for v in value)

        return nested
    raise TypeError(f"no wire check for {hint!r}")  # a programming error, not bad input


def _exactly(kind: type, value: object, what: str) -> object:
    if type(value) is not kind:  # bool is not an int here, nor an int a bool
        raise Malformed(f"{what} must be {kind.__name__}, got {value!r:.80}")
    return value


@functools.cache
def fields(cls: type) -> tuple[tuple[str, Check], ...]:
    """A NamedTuple's fields, in order, with their checks."""
    return tuple((f"{cls.__name__}.{n}", checker(h)) for n, h in typing.get_type_hints(cls).items())


def record(cls: type, raw: object) -> Any:
    """A NamedTuple shipped as a positional list, every field checked; trailing fields a
    newer release added are ignored."""
    known = fields(cls)
    if not isinstance(raw, list | tuple) or len(raw) < len(known):
        raise Malformed(f"{cls.__name__} must be a list of {len(known)} fields, got {raw!r:.80}")
    return cls(*[check(v, what) for (what, check), v in zip(known, raw, strict=False)])


def writes_done(results: Sequence[Any]) -> None:
    """Raise the first error among a pipeline's write replies (executed with
    ``raise_on_error=False`` so that a read's error is a reply, see :func:`read`)."""
    for reply in results:
        if isinstance(reply, Exception):
            raise reply


def read(kind: str, reply: Any, empty: Any) -> Any:
    """A read's reply from a pipeline, or ``empty`` if the key holds a value of the wrong type
    (nothing epp wrote: a malformed entry, counted); any other error is raised."""
    if wrong_type(reply):
        reject(kind, MALFORMED, reply)
        return empty
    if isinstance(reply, Exception):
        raise reply
    return reply


def wrong_type(reply: object) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


# Every kind and reason, zero until something is refused: the series exist from the start.
for _kind in KINDS:
    for _reason in REASONS:
        SHARED_REJECTED.labels(_kind, _reason)
