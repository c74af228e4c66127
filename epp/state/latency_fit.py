"""The latency model's statistics and fit (:mod:`epp.state.latency`): exponentially decayed
weighted least squares, a ridge fit towards a prior with non-negative coefficients, and the
fit's standard error. Pure arithmetic: no clock, no I/O."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

# Evidence halves in this many seconds.
HALF_LIFE_S = 30.0
# The prior counts as this many observations at unit features.
PRIOR_STRENGTH = 2.0
# A sample below the evidence's mean over this factor weighs as one at mean / this factor
# (relative_weight): bounds any one sample's weight at this factor squared.
RELATIVE_FLOOR = 10.0
# Observations before residuals are judged (the scale needs a few).
ROBUST_AFTER = 8.0


@dataclass(slots=True)
class Stats:
    """Exponentially decayed weighted least-squares statistics of one linear model."""

    dims: int
    xx: list[float] = field(default_factory=list)
    xy: list[float] = field(default_factory=list)
    weight: float = 0.0
    # Decayed mean absolute residual (its weight is ``weight``).
    abs_residual: float = 0.0
    as_of: float = 0.0
    # Decayed count and sum of the observed values, each counted once (outliers less): the
    # scale relative_weight measures observations against.
    count: float = 0.0
    y_sum: float = 0.0
    # Decayed weighted sum of squared observations (``y'Wy``): with ``X'X`` and ``X'y`` it
    # gives the fit's residual sum of squares (standard_error).
    yy: float = 0.0

    def __post_init__(self) -> None:
        if not self.xx:
            self.xx = [0.0] * (self.dims * self.dims)
            self.xy = [0.0] * self.dims

    def decay_to(self, now: float) -> None:
        if now <= self.as_of:
            return
        if self.weight or self.count:
            factor = 0.5 ** ((now - self.as_of) / HALF_LIFE_S)
            self.xx = [v * factor for v in self.xx]
            self.xy = [v * factor for v in self.xy]
            self.weight *= factor
            self.count *= factor
            self.y_sum *= factor
            self.yy *= factor
        self.as_of = now

    def add(
        self, x: Sequence[float], y: float, weight: float, residual: float, robust: float
    ) -> None:
        """One observation of weight ``weight``; ``robust`` (at most 1) is how much it counts
        towards the scale (``count``, ``y_sum``)."""
        n = self.dims
        for i in range(n):
            wx = weight * x[i]
            self.xy[i] += wx * y
            row = i * n
            for j in range(n):
                self.xx[row + j] += wx * x[j]
        total = self.weight + weight
        self.abs_residual += (abs(residual) - self.abs_residual) * weight / total
        self.weight = total
        self.count += robust
        self.y_sum += robust * y
        self.yy += weight * y * y

    def copy(self) -> Stats:
        return Stats(
            self.dims,
            list(self.xx),
            list(self.xy),
            self.weight,
            self.abs_residual,
            self.as_of,
            self.count,
            self.y_sum,
            self.yy,
        )

    def plus(self, other: Stats) -> Stats:
        """The sum of two statistics at the later time of the two."""
        a, b = self.copy(), other.copy()
        now = max(a.as_of, b.as_of)
        a.decay_to(now)
        b.decay_to(now)
        weight = a.weight + b.weight
        residual = (
            (a.abs_residual * a.weight + b.abs_residual * b.weight) / weight if weight else 0.0
        )
        return Stats(
            self.dims,
            [p + q for p, q in zip(a.xx, b.xx, strict=True)],
            [p + q for p, q in zip(a.xy, b.xy, strict=True)],
            weight,
            residual,
            now,
            a.count + b.count,
            a.y_sum + b.y_sum,
            a.yy + b.yy,
        )

    def encode(self) -> list[float]:
        head = [self.as_of, self.weight, self.abs_residual, self.count, self.y_sum, self.yy]
        return [*head, *self.xx, *self.xy]

    @classmethod
    def decode(cls, dims: int, values: Sequence[float]) -> Stats:
        head = 6
        if len(values) != head + dims * dims + dims:
            raise ValueError(f"expected {head + dims * dims + dims} numbers, got {len(values)}")
        as_of, weight, residual, count, y_sum, yy = (float(v) for v in values[:head])
        xx = [float(v) for v in values[head : head + dims * dims]]
        xy = [float(v) for v in values[head + dims * dims :]]
        numbers = (as_of, weight, residual, count, y_sum, yy, *xx, *xy)
        if not all(math.isfinite(v) for v in numbers):
            raise ValueError("non-finite statistics")
        return cls(dims, xx, xy, weight, residual, as_of, count, y_sum, yy)


def fit(stats: Stats, prior: Sequence[float]) -> tuple[float, ...]:
    """Ridge regression towards ``prior`` with non-negative coefficients (a term whose
    coefficient comes out negative is pinned at 0 and the others refitted)."""
    n = stats.dims
    free = list(range(n))
    while True:
        coef = _solve(stats, prior, free)
        negative = [i for i in free if coef[i] < 0.0]
        if not negative:
            return tuple(coef)
        free = [i for i in free if i not in negative]
        if not free:
            return tuple(0.0 for _ in range(n))


def _solve(stats: Stats, prior: Sequence[float], free: Sequence[int]) -> list[float]:
    n = stats.dims
    # (X'X + s I) beta = X'y + s prior, over the free coefficients (pinned ones are 0).
    b = [stats.xy[i] + PRIOR_STRENGTH * prior[i] for i in free]
    solution = _gauss(_normal_matrix(stats, free), b)
    out = [0.0] * n
    for i, value in zip(free, solution, strict=True):
        out[i] = value
    return out


def _normal_matrix(stats: Stats, free: Sequence[int]) -> list[list[float]]:
    """``X'X + s I`` over the ``free`` coefficients: the ridge fit's normal equations."""
    n = stats.dims
    return [[stats.xx[i * n + j] + (PRIOR_STRENGTH if i == j else 0.0) for j in free] for i in free]


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """The solution of ``a x = b`` (Gaussian elimination with partial pivoting; ``a`` and
    ``b`` are overwritten). ``a`` is ``X'X`` plus the ridge prior: positive definite."""
    m = len(b)
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        head = a[col][col]
        for r in range(col + 1, m):
            factor = a[r][col] / head
            if factor:
                for k in range(col, m):
                    a[r][k] -= factor * a[col][k]
                b[r] -= factor * b[col]
    solution = [0.0] * m
    for r in range(m - 1, -1, -1):
        solution[r] = (b[r] - sum(a[r][k] * solution[k] for k in range(r + 1, m))) / a[r][r]
    return solution


def relative_weight(stats: Stats, y: float) -> float:
    """An observation's weight before robustness: ``(m / y)**2``, ``m`` the mean of the
    observations so far, each counted once (``y_sum / count``), ``y`` at least ``m /
    RELATIVE_FLOOR``.

    Least squares on absolute errors let the largest samples set the fit: on a real CPU
    engine, whose prefill time grows faster than linearly, the intercept fell to ~0 and
    short prompts were predicted at half their TTFT (tests/contract/test_latency_model_contract.py,
    21% median error). Weighting by ``1/y**2`` fits relative errors, the measure the model is
    judged by; scaling by ``m**2`` keeps the weights near 1 at any latency scale, so the prior
    keeps its strength and an endpoint whose TTFTs are seconds learns as fast as one at
    milliseconds. ``m`` counts each observation once, not by its weight: the weighted mean
    (``X'y`` over ``X'X`` of the constant) is pulled towards the smallest observations, which
    weigh most, so after a 10 ms probe it stayed near 10 ms and every cold prefill that
    followed weighed ~1e-4: the endpoint learned nothing from them for minutes."""
    if stats.count <= 0.0 or stats.y_sum <= 0.0 or y <= 0.0:
        return 1.0
    mean = stats.y_sum / stats.count
    return (mean / max(y, mean / RELATIVE_FLOOR)) ** 2


def dot(coef: Sequence[float], x: Sequence[float]) -> float:
    # map with operator.mul: the products are summed in the same order as a generator would
    # give them, without a Python frame per term (a prediction per pick). Equal lengths by
    # construction (a model's dimensions).
    total: float = sum(map(operator.mul, coef, x))
    return total


def standard_error(stats: Stats, coef: Sequence[float], x: Sequence[float]) -> float:
    """The standard error of the fit ``coef`` at features ``x``: ``sigma * sqrt(x' (X'X + s
    I)^-1 x)``, ``sigma**2`` the weighted residual sum of squares (from the sufficient
    statistics: ``y'Wy - 2 b'X'Wy + b'X'WXb``) over the observations' count less the
    coefficients. 0 before ``ROBUST_AFTER`` observations' weight, as for the outlier test (the
    scale needs a few): one cold prefill per endpoint must still tell a 2x fleet apart in its
    first seconds."""
    n = stats.dims
    if stats.weight < ROBUST_AFTER or stats.count <= n:
        return 0.0
    fitted = sum(
        coef[i] * stats.xx[i * n + j] * coef[j] for i in range(n) for j in range(n)
    ) - 2.0 * dot(coef, stats.xy)
    sigma2 = max(0.0, stats.yy + fitted) / (stats.count - n)
    inverse_x = _gauss(_normal_matrix(stats, range(n)), list(x))
    return math.sqrt(sigma2 * max(0.0, dot(x, inverse_x)))
