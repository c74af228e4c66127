"""The request-body bytes this epp process holds, against ``server.max_buffered_bytes``.

epp reads every request body whole before it routes (the decision needs the JSON), and a body
held by flow control stays in memory while it waits. Each one is bounded by
``routing.max_body_bytes``, but not their sum: a few dozen concurrent uploads of the largest
allowed size would take more memory than the process has. So each stream counts the bytes it
received and has not yet handed back to Envoy, and a chunk that would take the process's total
past the budget is refused with a 503 and ``Retry-After`` (an OpenAI-style JSON error), before
it is kept; a body whose declared length does not fit in what is left is refused at the
headers. The bytes are given back once the stream's routing answer (or refusal) is sent, or
when the stream ends.
"""

from __future__ import annotations

from epp.errors import RequestError
from epp.observability import BUFFERED_BYTES

# The process's bytes held; one event loop runs every stream, so no lock.
_held = 0


def held() -> int:
    return _held


def take(size: int, budget: int) -> bool:
    """Count ``size`` more bytes held, if that stays within ``budget`` (0: no budget)."""
    global _held
    if budget and _held + size > budget:
        return False
    _held += size
    return True


def give(size: int) -> None:
    global _held
    _held -= size


def fits(size: int, budget: int) -> bool:
    """Whether ``size`` more bytes would fit now (a declared length, not yet received)."""
    return not budget or _held + size <= budget


def overloaded(budget: int) -> RequestError:
    return RequestError(
        503,
        f"epp is holding as many request bodies as it may ({budget} bytes, "
        "server.max_buffered_bytes). Retry after 1 s.",
        type="server_error",
        code="buffer_full",
        headers={"retry-after": "1"},
    )


BUFFERED_BYTES.set_function(held)
