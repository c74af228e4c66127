"""Tenant budgets: requests and tokens per sliding minute, per fairness id (tenant).

Pure bookkeeping, no I/O: the clock is passed in, so windows, leases and the Redis-down cap are
unit-tested with a fake one. :mod:`epp.admission.budget_sync` ships what this ledger records to
Redis and brings back leases and the group's windows; the router charges and refunds.

Windows are bucketed: :data:`BUCKETS` buckets of ``window / BUCKETS`` seconds, and a total
counts the current bucket and the :data:`BUCKETS` before it, so it always covers at least the
window (a request admitted now still counts until a full window has passed; never less).

Cluster-wide without a network wait per request: each process spends **leased slices** of a
tenant's budget. The group's window lives in Redis and counts every slice granted (and every
charge made after the fact); a process asks for a slice of twice its demand since the last sync
(at least one request's worth), spends it locally, and returns what it did not spend after
:data:`SLICE_SECONDS`. A grant never takes the group's window past the limit, so what the group
admits stays within it; and a grant is at most ``1 / (SLICE_SPLIT x processes)`` of what is left
(or one request's worth), so a burst is served at once while the window has room, and near the
limit the budget stranded in other processes' unspent slices is a small share of the little
that is left. A request that finds no slice big enough may still be admitted and owed (charged
at the next sync), up to such a slice, while the group's window had at least :data:`DEBT_ROOM`
of the budget left at the last sync: far from the limit a burst never waits for a lease, and
near it only leased slices are spent. A tenant new to this process may owe its first request.

Tokens: a request is charged its expected tokens at admission (prompt tokens plus the output it
may generate); when its response's usage arrives, the difference to the real prompt plus
completion tokens is charged (or refunded) in the bucket of the admission, so the window holds
what was really used. A request refused later (flow control) is refunded.

Redis unreachable (or not answering yet): **local mode**. The process admits at most
``limit / processes`` in its own window (the process count last seen in the group; 1 if never
seen), never the whole budget; its spends are charged to the group's window when Redis answers
again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from epp.errors import RequestError

Kind = Literal["requests", "tokens"]
KINDS: tuple[Kind, ...] = ("requests", "tokens")
BUCKETS = 60
# A slice not spent within this many seconds goes back to the group.
SLICE_SECONDS = 1.0
# A slice is at most what is left of the window over SLICE_SPLIT x processes: what the others
# may hold unspent while one is refused stays a fraction of what is left.
SLICE_SPLIT = 2
# Spending beyond the slices held (owed to the group) only while this share of the budget was
# left at the last sync.
DEBT_ROOM = 0.5
DROPPED_REASON = "rejected-budget"
_HEADER_NAMES: Mapping[Kind, tuple[str, str, str]] = {
    kind: (
        f"x-ratelimit-limit-{kind}",
        f"x-ratelimit-remaining-{kind}",
        f"x-ratelimit-reset-{kind}",
    )
    for kind in KINDS
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Requests and tokens per window; 0 is unlimited."""

    rpm: int = 0
    tpm: int = 0

    def of(self, kind: Kind) -> int:
        return self.rpm if kind == "requests" else self.tpm


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    """The ``budgets`` section: limits per tenant (fairness id), the default for the others,
    and the window (one minute; shorter only for tests and demonstrations)."""

    tenants: Mapping[str, Limits] = field(default_factory=dict)
    default: Limits = field(default_factory=Limits)
    window_seconds: float = 60.0

    def limits(self, tenant: str) -> Limits:
        return self.tenants.get(tenant, self.default)

    @property
    def enabled(self) -> bool:
        return any(lim.rpm or lim.tpm for lim in (self.default, *self.tenants.values()))

    def label(self, tenant: str) -> str:
        """The tenant's metric label: a configured name, else ``default`` (bounded)."""
        return tenant if tenant in self.tenants else "default"


class Window:
    """Amounts per bucket; :meth:`total` covers at least the last ``seconds``."""

    __slots__ = ("_buckets", "width")

    def __init__(self, seconds: float) -> None:
        self.width = seconds / BUCKETS
        # [bucket index, amount], oldest first.
        self._buckets: deque[list[float]] = deque()

    def _index(self, t: float) -> int:
        return math.floor(t / self.width)

    def _prune(self, now: float) -> None:
        oldest = self._index(now) - BUCKETS
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def add(self, at: float, amount: float) -> None:
        """Record ``amount`` (negative: a refund) in the bucket of time ``at``."""
        index = self._index(at)
        for bucket in reversed(self._buckets):
            if bucket[0] == index:
                bucket[1] += amount
                return
            if bucket[0] < index:
                break
        self._buckets.append([index, amount])
        if len(self._buckets) > 1 and self._buckets[-2][0] > index:
            self._buckets = deque(sorted(self._buckets))

    def set(self, now: float, ages: Iterable[tuple[int, float]]) -> None:
        """Replace the contents with amounts by age in buckets (0: the current one)."""
        current = self._index(now)
        self._buckets = deque(sorted([current - age, amount] for age, amount in ages))

    def total(self, now: float) -> float:
        self._prune(now)
        return sum(amount for _, amount in self._buckets)

    def seconds_until_freed(self, now: float, amount: float) -> float:
        """How long until at least ``amount`` has left the window (inf: never)."""
        self._prune(now)
        if amount <= 0:
            return 0.0
        freed = 0.0
        for index, value in self._buckets:
            freed += value
            if freed >= amount:
                return max(0.0, (index + BUCKETS + 1) * self.width - now)
        return math.inf

    def seconds_until_empty(self, now: float) -> float:
        """How long until everything now in the window has left it."""
        self._prune(now)
        if not any(amount > 0 for _, amount in self._buckets):
            return 0.0
        newest = max(index for index, amount in self._buckets if amount > 0)
        return max(0.0, (newest + BUCKETS + 1) * self.width - now)


class Account:
    """One tenant's budget of one kind, as this process sees and spends it."""

    __slots__ = ("balance", "charges", "demand", "group", "largest", "leased_at", "spent")

    def __init__(self, window: float) -> None:
        # What this process spent (all modes): the local-mode cap and the debt rule read it.
        self.spent = Window(window)
        # The group's window at the last sync (granted slices included); None before one.
        self.group: Window | None = None
        # Leased from the group and not spent yet, and when it was granted.
        self.balance = 0
        self.leased_at = 0.0
        # Charges for the group's window not shipped yet: (when, amount).
        self.charges: list[tuple[float, int]] = []
        # Asked for since the last sync (admitted or not): sizes the next slice.
        self.demand = 0
        self.largest = 1

    def pending(self) -> int:
        return sum(amount for _, amount in self.charges)


@dataclass(frozen=True, slots=True)
class Charge:
    """What admitting one request spent; refunded or corrected later by the ledger."""

    tenant: str
    tokens: int
    at: float
    # x-ratelimit-* values at admission, for the response headers.
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Refusal:
    tenant: str
    kind: Kind
    limit: int
    window: float
    retry_after: int
    headers: Mapping[str, str]

    def error(self) -> RequestError:
        unit = self.kind
        return RequestError(
            429,
            f"Rate limit reached for {unit} of tenant '{self.tenant}': limit {self.limit} "
            f"{unit} per {duration(self.window)}. Retry after {self.retry_after} s.",
            type="rate_limit_error",
            param=unit,
            code="rate_limit_exceeded",
            headers={
                "retry-after": str(self.retry_after),
                "x-epp-request-dropped-reason": DROPPED_REASON,
                **self.headers,
            },
        )


@dataclass(frozen=True, slots=True)
class Ask:
    """One account's part of a sync: charges to record, and a slice to ask for."""

    tenant: str
    kind: Kind
    limit: int
    # The slice wanted, and the least worth granting (one request's worth).
    want: int
    least: int
    # (seconds ago, amount)
    charges: tuple[tuple[float, int], ...]


class Budgets:
    """This process's ledger of every tenant's budgets."""

    def __init__(self, policy: BudgetPolicy) -> None:
        self._policy = policy
        self._accounts: dict[tuple[str, Kind], Account] = {}
        # Set by the sync: whether the group's window is reachable, and its size.
        self.shared = False
        self.members = 1
        # Whether a sync ships charges to a group (Redis): alone, nothing is kept for it.
        self.grouped = False
        self._pruned_at = 0.0

    @property
    def policy(self) -> BudgetPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: BudgetPolicy) -> None:
        # New limits apply at once to the windows as they are; a new window length starts
        # the windows afresh (their buckets would mean other times).
        if policy.window_seconds != self._policy.window_seconds:
            self._accounts.clear()
        self._policy = policy

    def accounts(self) -> Mapping[tuple[str, Kind], Account]:
        return self._accounts

    def _account(self, tenant: str, kind: Kind) -> Account:
        account = self._accounts.get((tenant, kind))
        if account is None:
            account = self._accounts[(tenant, kind)] = Account(self._policy.window_seconds)
        return account

    def charge(self, tenant: str, tokens: int, now: float) -> Charge | Refusal | None:
        """Admit a request of ``tokens`` expected tokens for ``tenant`` now (spending from both
        budgets), or refuse it (spending nothing). None: the tenant has no budget."""
        limits = self._policy.limits(tenant)
        if not (limits.rpm or limits.tpm):
            return None
        if now - self._pruned_at >= self._policy.window_seconds:
            self._prune(now)
        costs: dict[Kind, int] = {"requests": 1, "tokens": tokens}
        for kind in KINDS:
            limit = limits.of(kind)
            if not limit:
                continue
            account = self._account(tenant, kind)
            if self.grouped:  # sizes the next slice asked for
                account.demand += costs[kind]
            account.largest = max(account.largest, costs[kind])
            if not self._may_spend(account, limit, costs[kind], now):
                return Refusal(
                    tenant,
                    kind,
                    limit,
                    self._policy.window_seconds,
                    self._retry_after(account, limit, costs[kind], now),
                    self.headers(tenant, now),
                )
        for kind in KINDS:
            if limits.of(kind):
                self._spend(self._account(tenant, kind), costs[kind], now)
        return Charge(tenant, tokens, now, self.headers(tenant, now))

    def correct(self, charge: Charge, tokens: int) -> None:
        """The request really used ``tokens`` (prompt + completion, from the usage)."""
        if self._policy.limits(charge.tenant).tpm:
            self._adjust(self._account(charge.tenant, "tokens"), charge.at, tokens - charge.tokens)

    def refund(self, charge: Charge) -> None:
        """The admitted request was refused later and never ran."""
        limits = self._policy.limits(charge.tenant)
        costs: dict[Kind, int] = {"requests": 1, "tokens": charge.tokens}
        for kind, amount in costs.items():
            if limits.of(kind):
                self._adjust(self._account(charge.tenant, kind), charge.at, -amount)

    def _adjust(self, account: Account, at: float, amount: int) -> None:
        if amount:
            account.spent.add(at, amount)
            self._owe(account, at, amount)

    def _owe(self, account: Account, at: float, amount: int) -> None:
        """Keep ``amount`` for the group's window (nothing to keep without a group)."""
        if self.grouped:
            account.charges.append((at, amount))

    def _prune(self, now: float) -> None:
        """Forget tenants idle for a whole window (fairness ids are many over time)."""
        self._pruned_at = now
        for key, account in list(self._accounts.items()):
            if _idle(account, now):
                del self._accounts[key]

    def _share(self, limit: int) -> float:
        return limit / max(1, self.members)

    def _group_used(self, account: Account, now: float) -> float:
        """What the group has taken of the window, as far as this process knows: granted
        slices (its own unspent balance excluded) and its charges not shipped yet."""
        assert account.group is not None
        return account.group.total(now) - account.balance + account.pending()

    def _may_spend(self, account: Account, limit: int, cost: int, now: float) -> bool:
        if not self.shared:
            # Local mode: this process's share, whatever the others do.
            return account.spent.total(now) + cost <= self._share(limit)
        if account.balance >= cost:
            return True
        # No slice big enough: spend now and owe it (charged at the next sync), up to a slice,
        # but only while the group's window had at least DEBT_ROOM of the budget left at the
        # last sync: what the others took since is not visible here. Near the limit only
        # leased slices are spent, and grants never pass the limit. A tenant new to this
        # process (no view of the group yet) may owe one request: its first never waits.
        debt = account.pending() + cost - account.balance
        if account.group is None:
            return debt <= account.largest
        left = limit - account.group.total(now) - account.pending()
        cap = max(account.largest, left / (SLICE_SPLIT * max(1, self.members)))
        return debt <= cap and left - cost >= DEBT_ROOM * limit

    def _spend(self, account: Account, cost: int, now: float) -> None:
        account.spent.add(now, cost)
        if self.shared and account.group is not None:
            taken = min(account.balance, cost)
            account.balance -= taken
            debt = cost - taken
        else:
            debt = cost
        if debt:
            self._owe(account, now, debt)

    def _retry_after(self, account: Account, limit: int, cost: int, now: float) -> int:
        """Whole seconds until enough of the window frees for ``cost``."""
        if self.shared and account.group is not None:
            wait = account.group.seconds_until_freed(
                now, self._group_used(account, now) + cost - limit
            )
        else:
            wait = account.spent.seconds_until_freed(
                now, account.spent.total(now) + cost - self._share(limit)
            )
        if math.isinf(wait):  # more than the limit itself: no wait makes room; say a window
            wait = self._policy.window_seconds
        return max(1, math.ceil(wait))

    def remaining(self, tenant: str, kind: Kind, now: float) -> tuple[int, float]:
        """What ``tenant`` may still spend of ``kind`` in the window, and the seconds until
        its window is empty again."""
        limit = self._policy.limits(tenant).of(kind)
        account = self._account(tenant, kind)
        if self.shared and account.group is not None:
            left = limit - self._group_used(account, now)
            reset = account.group.seconds_until_empty(now)
        else:
            left = self._share(limit) - account.spent.total(now)
            reset = account.spent.seconds_until_empty(now)
        return max(0, math.floor(left)), reset

    def headers(self, tenant: str, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for ``tenant`` (the kinds it has a limit for)."""
        limits = self._policy.limits(tenant)
        out: dict[str, str] = {}
        for kind in KINDS:
            limit = limits.of(kind)
            if not limit:
                continue
            left, reset = self.remaining(tenant, kind, now)
            names = _HEADER_NAMES[kind]
            out[names[0]] = str(limit)
            out[names[1]] = str(left)
            out[names[2]] = duration(reset)
        return out

    # -- the sync's side -------------------------------------------------------------------

    def asks(self, now: float) -> list[Ask]:
        """Take what to send to the group's windows: every account's pending charges (its
        unspent slice returned when older than :data:`SLICE_SECONDS`) and the slice it wants."""
        window = self._policy.window_seconds
        out: list[Ask] = []
        for (tenant, kind), account in list(self._accounts.items()):
            limit = self._policy.limits(tenant).of(kind)
            if not limit:
                del self._accounts[(tenant, kind)]
                continue
            if account.balance and now - account.leased_at >= SLICE_SECONDS:
                account.charges.append((account.leased_at, -account.balance))
                account.balance = 0
            if _idle(account, now):
                del self._accounts[(tenant, kind)]
                continue
            # Twice the demand since the last sync, at least one request's worth while the
            # tenant is active (spent in the window); an inactive one holds nothing.
            active = account.demand or account.spent.total(now) > 0
            want = max(account.largest, 2 * account.demand) if active else 0
            account.demand = 0
            charges = tuple(
                (now - at, amount) for at, amount in account.charges if now - at < window
            )
            account.charges = []
            ask = max(0, want - account.balance)
            out.append(Ask(tenant, kind, limit, ask, min(ask, account.largest), charges))
        return out

    def granted(self, ask: Ask, grant: int, ages: Iterable[tuple[int, float]], now: float) -> None:
        """The group recorded ``ask``'s charges and granted ``grant``; ``ages``: its window."""
        account = self._account(ask.tenant, ask.kind)
        if grant > 0:
            if account.balance:
                # One lease time per account: the older balance moves to this grant's bucket.
                account.charges.append((account.leased_at, -account.balance))
                account.charges.append((now, account.balance))
                grant += account.balance
            account.balance = grant
            account.leased_at = now
        if account.group is None:
            account.group = Window(self._policy.window_seconds)
        account.group.set(now, ages)

    def failed(self, asks: Iterable[Ask], now: float) -> None:
        """The sync did not reach the group: keep the charges for the next one."""
        for ask in asks:
            account = self._accounts.get((ask.tenant, ask.kind))
            if account is not None:
                account.charges.extend((now - ago, amount) for ago, amount in ask.charges)


def _idle(account: Account, now: float) -> bool:
    """Nothing spent in a whole window, nothing held or owed, nothing asked since the last
    sync: the account can be forgotten (fairness ids are many over time)."""
    return (
        not account.demand
        and account.spent.total(now) <= 0
        and not account.balance
        and not account.charges
    )


def duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"
