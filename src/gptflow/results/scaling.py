"""The fits of a study: scaling laws over a family of training runs on shared data.

Three fits, each deterministic (a grid search, then a local refinement by scipy.optimize):

- :func:`fit_power_law`: ``L(N) = E + A / N**alpha`` over model sizes (final losses).
- :func:`fit_two_term`: ``L(N, D) = E + A / N**alpha + B / D**beta`` over sizes and tokens
  (Chinchilla's "approach 3"), and from it the compute-optimal size and tokens for a budget
  (:meth:`TwoTermFit.compute_optimal`, closed form under ``C = k * N * D``).
- :func:`compute_frontier`: Chinchilla's "approach 1": along each run's loss-versus-FLOPs curve,
  which run is lowest at each FLOP budget, and ``N_opt = k * C**a`` fitted to the winners.

Method: variable projection. For fixed exponents the law is linear in (E, A[, B]), so those
come from a least-squares solve with every coefficient >= 0 (``scipy.optimize.nnls``, on
columns scaled to unit norm). Only the exponents are searched: a log grid over ``EXPONENTS``,
then ``scipy.optimize.minimize_scalar`` (bounded) on log(alpha) between the grid's neighbours of
its best point (one exponent), or ``scipy.optimize.least_squares`` on the residuals over
(log alpha, log beta), bounded to ``EXPONENTS`` (two).

Why least squares in loss space: Chinchilla fitted approach 3 with a Huber loss on the
residuals of log-loss, which guards ~400 runs against a few outliers. A study has a handful of
points (6-20), where an outlier cannot be told from signal and a robust loss only makes the
fit depend on its threshold. Plain least squares on the losses is what we can defend with so
few points: the maximum-likelihood fit under Gaussian noise of one size in loss units, linear
in (E, A, B) so variable projection applies, and its residual (``rmse``) is in the units the
report prints. ``max_rel_error`` shows how far the worst point is off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares, minimize_scalar, nnls

from gptflow.errors import GptflowError

EXPONENTS = (0.01, 3.0)  # the range alpha and beta are searched in
POWER_LAW_GRID = 200  # log-spaced exponents tried before the bounded scalar search
TWO_TERM_GRID = 30  # per exponent: a 30 x 30 grid of (alpha, beta) before least squares
FRONTIER_BUDGETS = 32  # log-spaced FLOP budgets laid over the curves' range


@dataclass(frozen=True)
class PowerLawFit:
    """``L(N) = E + A / N**alpha``, fitted to `points` (size, loss) pairs."""

    E: float
    A: float
    alpha: float
    rmse: float  # root mean square of the residuals, in loss units
    max_rel_error: float  # max |pred - loss| / loss over the points
    points: int

    def predict(self, n) -> np.ndarray | float:
        out = self.E + self.A / np.asarray(n, dtype=float) ** self.alpha
        return float(out) if np.ndim(out) == 0 else out

    @property
    def warnings(self) -> list[str]:
        """Why these numbers may say little (:func:`fit_warnings`)."""
        return fit_warnings({"alpha": self.alpha}, self.points, 3)

    def to_json(self) -> dict:
        return {"form": "E + A / N^alpha", "E": self.E, "A": self.A, "alpha": self.alpha,
                "rmse": self.rmse, "max_rel_error": self.max_rel_error, "points": self.points,
                "warnings": self.warnings}  # fmt: skip


@dataclass(frozen=True)
class TwoTermFit:
    """``L(N, D) = E + A / N**alpha + B / D**beta``, fitted to `points` (size, tokens, loss)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    rmse: float  # root mean square of the residuals, in loss units
    max_rel_error: float  # max |pred - loss| / loss over the points
    points: int

    def predict(self, n, d) -> np.ndarray | float:
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        out = self.E + self.A / n**self.alpha + self.B / d**self.beta
        return float(out) if np.ndim(out) == 0 else out

    @property
    def warnings(self) -> list[str]:
        """Why these numbers may say little (:func:`fit_warnings`)."""
        return fit_warnings({"alpha": self.alpha, "beta": self.beta}, self.points, 5)

    def to_json(self) -> dict:
        return {"form": "E + A / N^alpha + B / D^beta", "E": self.E, "A": self.A,
                "alpha": self.alpha, "B": self.B, "beta": self.beta, "rmse": self.rmse,
                "max_rel_error": self.max_rel_error, "points": self.points,
                "warnings": self.warnings}  # fmt: skip

    def compute_optimal(self, flops: float, flops_per_param_token: float = 6.0) -> dict:
        """The size and tokens that minimise the law at `flops` under ``C = k * N * D``
        (k = `flops_per_param_token`): setting d/dN of ``A/N^alpha + B/(X/N)^beta`` (X = C/k)
        to 0 gives ``N_opt = G * X**(beta/(alpha+beta))``, ``G = (alpha*A/(beta*B))**(1/(alpha+
        beta))``, ``D_opt = X / N_opt``. Needs A, B > 0 (a zero term has no optimum)."""
        _positive("flops", [flops])
        _positive("flops_per_param_token", [flops_per_param_token])
        if self.A <= 0 or self.B <= 0:
            raise GptflowError(
                f"compute_optimal: the fit has A={self.A:g}, B={self.B:g}; with a zero term the "
                "loss keeps falling along it and there is no compute-optimal size"
            )
        x = flops / flops_per_param_token
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / s)
        n = g * x ** (self.beta / s)
        d = x / n
        return {"flops": float(flops), "parameters": float(n), "tokens": float(d),
                "loss": float(self.predict(n, d))}  # fmt: skip


def fit_warnings(exponents: dict[str, float], points: int, parameters: int) -> list[str]:
    """What makes a fit's numbers weak: an exponent at the edge of the range searched (the
    points do not pin it: the optimum may lie beyond), and no more points than parameters
    (the curve passes through every point; its error says nothing)."""
    lo, hi = EXPONENTS
    out = [
        f"{name} {value:.3g} is at the edge of the range searched ({lo:g} to {hi:g}): these "
        f"points do not determine it"
        for name, value in exponents.items()
        if not lo * 1.01 < value < hi / 1.01
    ]
    if points <= parameters:
        out.append(
            f"{points} points for {parameters} parameters: the curve passes through them, so "
            f"its error says nothing about the law; add sizes"
        )
    return out


def fit_power_law(n, loss) -> PowerLawFit:
    """``E + A / N**alpha`` (E, A >= 0) to final losses over model sizes `n`, least squares in
    loss units; needs 3 distinct sizes (3 parameters)."""
    n, loss = _positive("parameters", n), _positive("loss", loss)
    _same_length(("parameters", n), ("loss", loss))
    if len(np.unique(n)) < 3:
        raise GptflowError(
            f"fit_power_law: {len(n)} points with {len(np.unique(n))} distinct sizes; "
            "E + A / N^alpha has 3 parameters and needs at least 3 distinct sizes"
        )

    def sse(log_alpha: float) -> float:
        return _power_law_solve(n, loss, math.exp(log_alpha))[1]

    grid = np.log(np.geomspace(*EXPONENTS, POWER_LAW_GRID))
    i = int(np.argmin([sse(g) for g in grid]))
    bounds = (grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)])
    best = minimize_scalar(sse, bounds=bounds, method="bounded", options={"xatol": 1e-10})
    alpha = math.exp(best.x)
    (e, a), _ = _power_law_solve(n, loss, alpha)
    fit = PowerLawFit(
        E=float(e), A=float(a), alpha=alpha, rmse=0.0, max_rel_error=0.0, points=len(n)
    )
    rmse, rel = _residuals(fit.predict(n), loss)
    return replace(fit, rmse=rmse, max_rel_error=rel)


def fit_two_term(n, d, loss) -> TwoTermFit:
    """``E + A / N**alpha + B / D**beta`` (E, A, B >= 0) to losses of runs of size `n` trained
    on `d` tokens, least squares in loss units; needs 6 points over 2+ sizes and 2+ token
    counts (5 parameters, and each term must vary)."""
    n, d, loss = _positive("parameters", n), _positive("tokens", d), _positive("loss", loss)
    _same_length(("parameters", n), ("tokens", d), ("loss", loss))
    sizes, tokens = len(np.unique(n)), len(np.unique(d))
    if len(n) < 6 or sizes < 2 or tokens < 2:
        raise GptflowError(
            f"fit_two_term: {len(n)} points, {sizes} distinct sizes, {tokens} distinct token "
            "counts; the 5-parameter law needs at least 6 points over 2+ sizes and 2+ token counts"
        )
    lo, hi = np.log(EXPONENTS)

    def residuals(p: np.ndarray) -> np.ndarray:
        x = _two_term_columns(n, d, *np.exp(p))
        return x @ _nnls(x, loss)[0] - loss

    grid = np.linspace(lo, hi, TWO_TERM_GRID)
    start = min(((a, b) for a in grid for b in grid), key=lambda p: _sse(residuals(np.array(p))))
    best = least_squares(residuals, start, bounds=(lo, hi), xtol=1e-12, ftol=1e-12, gtol=1e-12)
    alpha, beta = (float(x) for x in np.exp(best.x))
    (e, a, b), _ = _two_term_solve(n, d, loss, alpha, beta)
    e, a, b = float(e), float(a), float(b)
    fit = TwoTermFit(e, a, alpha, b, beta, rmse=0.0, max_rel_error=0.0, points=len(n))
    rmse, rel = _residuals(fit.predict(n, d), loss)
    return replace(fit, rmse=rmse, max_rel_error=rel)


def compute_frontier(curves: dict[str, tuple[float, list[float], list[float]]]) -> dict:
    """Chinchilla's approach 1 over `curves` (run name -> (parameters, training FLOPs so far,
    validation loss at each)): at each of ``FRONTIER_BUDGETS`` log-spaced budgets that 2+ runs'
    curves cover, the run with the lowest loss (linear in log-FLOPs between a curve's points);
    then ``N_opt = k * C**a`` by least squares of log N on log C over those budgets."""
    runs = [_curve(name, *curve) for name, curve in sorted(curves.items())]
    lo, hi = min(r[2][0] for r in runs), max(r[2][-1] for r in runs)
    budgets, names, sizes, losses = [], [], [], []
    for log_c in np.linspace(lo, hi, FRONTIER_BUDGETS):
        covering = [
            (float(np.interp(log_c, x, y)), name, size)
            for name, size, x, y in runs
            if x[0] <= log_c <= x[-1]
        ]
        if len(covering) >= 2:
            loss, name, size = min(covering)
            budgets.append(float(np.exp(log_c)))
            names.append(name)
            sizes.append(size)
            losses.append(loss)
    if len(budgets) < 3 or len(set(sizes)) < 2:
        raise GptflowError(
            f"compute_frontier: {len(budgets)} FLOP budgets covered by 2+ runs, won by "
            f"{len(set(sizes))} distinct sizes; N_opt = k * C^a needs 3+ budgets and 2+ winning "
            "sizes: add runs of other sizes whose FLOP ranges overlap"
        )
    a, log_k = np.polyfit(np.log(budgets), np.log(sizes), 1)
    return {"budgets": budgets, "best_run": names, "best_parameters": sizes,
            "best_loss": losses, "k": float(np.exp(log_k)), "a": float(a),
            "points": len(budgets)}  # fmt: skip


def optimal_size(frontier: dict, flops: float) -> float:
    """``k * flops**a``: the compute-optimal size at `flops` from :func:`compute_frontier`."""
    _positive("flops", [flops])
    return float(frontier["k"] * flops ** frontier["a"])


def _positive(name: str, values) -> np.ndarray:
    """`values` as a 1-d float array, or a GptflowError naming the first NaN/inf/non-positive."""
    try:
        a = np.asarray(values, dtype=float).ravel()
    except (TypeError, ValueError) as e:
        raise GptflowError(f"scaling: {name} must be numbers ({e})") from None
    bad = ~np.isfinite(a) | (a <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise GptflowError(f"scaling: {name}[{i}] is {float(a[i])}; {name} must be finite and > 0")
    return a


def _same_length(*named: tuple[str, np.ndarray]) -> None:
    if len({len(v) for _, v in named}) > 1:
        lengths = ", ".join(f"{name} has {len(v)}" for name, v in named)
        raise GptflowError(f"scaling: {lengths} values; they must be the same length")


def _curve(name: str, size: float, flops, loss) -> tuple[str, float, np.ndarray, np.ndarray]:
    """One run's curve checked: (name, size, log FLOPs increasing, loss)."""
    size = float(_positive(f"{name}: parameters", [size])[0])
    flops, loss = _positive(f"{name}: flops", flops), _positive(f"{name}: loss", loss)
    _same_length((f"{name}: flops", flops), (f"{name}: loss", loss))
    if len(flops) < 2 or (np.diff(flops) <= 0).any():
        raise GptflowError(
            f"compute_frontier: run {name!r} has {len(flops)} FLOP values; a curve needs 2+ "
            "points with FLOPs strictly increasing along training"
        )
    return name, size, np.log(flops), loss


def _residuals(pred: np.ndarray, loss: np.ndarray) -> tuple[float, float]:
    """(rmse in loss units, max relative error) of `pred` against `loss`."""
    r = pred - loss
    return float(np.sqrt(np.mean(r**2))), float(np.max(np.abs(r) / loss))


def _power_law_solve(n, loss, alpha: float) -> tuple[np.ndarray, float]:
    return _nnls(np.column_stack([np.ones_like(n), n**-alpha]), loss)


def _two_term_columns(n, d, alpha: float, beta: float) -> np.ndarray:
    return np.column_stack([np.ones_like(n), n**-alpha, d**-beta])


def _two_term_solve(n, d, loss, alpha: float, beta: float) -> tuple[np.ndarray, float]:
    return _nnls(_two_term_columns(n, d, alpha, beta), loss)


def _sse(r: np.ndarray) -> float:
    return float(r @ r)


def _nnls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """min |x c - y|^2 over c >= 0 (``scipy.optimize.nnls``), solved on the columns scaled to
    unit norm: N^-alpha is ~1e-3 next to the column of ones. Returns (c, sum of squares)."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x / scale, y)
    return coef / scale, _sse(x @ (coef / scale) - y)
