"""The fit of the α–β–γ model (`jdp.parallel.cost`) to the times `jdp bench allreduce` measured.

Each row is one strategy on k devices and one buffer; its strategy (looked up in the registry by
the name the bench wrote) prices the row by its own `Allreduce.cost`, so the fit needs no table of
algorithm names. In every algorithm r = b/2, so γ and β cannot be told apart from one algorithm's
times: the fit keeps γ only if its column is independent of the others and folds it into β otherwise.
"""

import itertools
import statistics
from collections.abc import Sequence

import numpy as np

from jdp.errors import ConfigError
from jdp.parallel import allreduce
from jdp.parallel.cost import Cost, Levels


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best of every subset's least squares that
    keeps all coefficients ≥ 0 (exact, as the optimum is an unconstrained fit on its support)."""
    n = a.shape[1]
    best, best_cost = np.zeros(n), float(np.sum(y**2))
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            cols = list(support)
            x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.all(x >= 0):
                full = np.zeros(n)
                full[cols] = x
                cost = float(np.sum((a @ full - y) ** 2))
                if cost < best_cost - 1e-18 * max(best_cost, 1.0):
                    best, best_cost = full, cost
    return best


def cost_of(name: str) -> Cost | None:
    """The cost of the registered strategy `name` (as a bench row names it); None if it has none or is unknown."""
    try:
        return allreduce.get(name).cost
    except ConfigError:
        return None


def levels_of(cost: Cost, k: int, leaf_bytes: Sequence[float], hosts: int | None = None) -> Levels | None:
    """`cost`'s terms on k devices with no grouping, or, for a strategy that needs one, in `hosts` groups."""
    levels = cost.terms(k, leaf_bytes, None)
    if levels is None and hosts:
        levels = cost.terms(k, leaf_bytes, k // hosts)
    return levels


def features(row: dict, shared: bool = False) -> tuple[float, float, float] | None:
    """(m, b, r) of a `jdp bench allreduce` row, all levels on the one link measured; None if it has no cost.

    With `shared`, b is the bytes all devices send (see `Link`). A strategy that needs a grouping of
    its k devices (`hierarchical`) takes it from its name (`hierarchical:2x4`) or the row's `hosts`.
    """
    cost = cost_of(row["algorithm"])
    levels = None if cost is None else levels_of(cost, row["devices"], [row["size_bytes"]], row.get("hosts"))
    if levels is None:
        return None
    total = levels["intra"] + levels["inter"]
    if shared:  # the same cores copy and add: the additions' time is inside β
        return total.messages, total.bytes_total, 0.0
    return total.messages, total.bytes_sent, total.bytes_reduced


def fit(rows: Sequence[dict], shared: bool = False) -> dict:
    """α, β, γ ≥ 0 of one algorithm from its rows (time_us over sizes × device counts).

    Least squares on relative error (each row divided by its time), so a 4 KiB buffer counts as
    much as a 64 MiB one. γ is fitted only if bytes reduced is not a multiple of bytes sent.
    `shared`: the link is one medium all devices' bytes cross (see `Link`).

    Returns:
      alpha_s, beta_s_per_byte, gamma_s_per_byte, gamma_fitted, rows, and residuals: each row's
      devices, size_bytes, measured_us, predicted_us and relative_error.
    """
    x = np.array([features(r, shared) for r in rows], dtype=float)
    t = np.array([r["time_us"] * 1e-6 for r in rows])
    with_gamma = np.linalg.matrix_rank(x / np.linalg.norm(x, axis=0).clip(1e-300), tol=1e-9) == 3
    design = x if with_gamma else x[:, :2]
    coef = nnls(design / t[:, None], np.ones_like(t))
    alpha, beta = coef[0], coef[1]
    gamma = coef[2] if with_gamma else 0.0
    predicted = x @ np.array([alpha, beta, gamma])
    return {
        "alpha_s": float(alpha), "beta_s_per_byte": float(beta), "gamma_s_per_byte": float(gamma),
        "gamma_fitted": bool(with_gamma), "shared": shared, "rows": len(rows),
        "residuals": [{"devices": r["devices"], "size_bytes": r["size_bytes"], "measured_us": r["time_us"],
                       "predicted_us": float(p * 1e6), "relative_error": float(p / m - 1)}
                      for r, p, m in zip(rows, predicted, t)],
    }


def predict_us(model: dict, row: dict) -> float:
    """A fitted algorithm's time in µs for a row's (algorithm, devices, size_bytes[, hosts])."""
    m, b, r = features(row, model["shared"])
    return (m * model["alpha_s"] + b * model["beta_s_per_byte"] + r * model["gamma_s_per_byte"]) * 1e6


def fit_all(rows: Sequence[dict], held_out: int | None = None, shared: bool = False, say=print) -> dict:
    """Fits every algorithm in `rows`; with `held_out`, on the other device counts, and predicts that one.

    `shared`: the devices share one link (simulated CPU devices share the host's memory; see `Link`).

    Algorithms with no cost (or too few rows) are skipped with one line through `say`.

    Returns:
      {"algorithms": {name: fit}, "held_out": None or {"devices", "per_algorithm": {name: {median, worst,
      errors}}, "median_relative_error", "worst_relative_error"}}.
    """
    by_name: dict[str, list[dict]] = {}
    for r in rows:  # one fit per algorithm its cost names, over its groupings (`hierarchical:2x2`, `:2x4`, ...)
        cost = cost_of(r["algorithm"])
        by_name.setdefault(cost.fits[0] if cost is not None and cost.fits else r["algorithm"], []).append(r)
    fits, held = {}, {}
    for name, mine in by_name.items():
        if features(mine[0]) is None:
            why = ("its rows do not say how many hosts (`hosts`) its devices are on" if cost_of(name)
                   else "no cost for it (`jdp.Allreduce.cost`; a plugin's strategy needs its `--plugin`)")
            say(f"fit: skipping `{name}`: {why}")
            continue
        train = [r for r in mine if r["devices"] != held_out]
        if len(train) < 2:
            say(f"fit: skipping `{name}`: {len(train)} row(s) to fit")
            continue
        fits[name] = fit(train, shared)
        test = [r for r in mine if r["devices"] == held_out]
        if test:
            errors = [predict_us(fits[name], r) / r["time_us"] - 1 for r in test]
            held[name] = {"median_relative_error": statistics.median(map(abs, errors)),
                          "worst_relative_error": max(map(abs, errors)),
                          "errors": [{"size_bytes": r["size_bytes"], "measured_us": r["time_us"],
                                      "predicted_us": predict_us(fits[name], r), "relative_error": e}
                                     for r, e in zip(test, errors)]}
    record: dict = {"link": "shared" if shared else "per-device", "algorithms": fits, "held_out": None}
    if held:
        every = [abs(e["relative_error"]) for h in held.values() for e in h["errors"]]
        record["held_out"] = {"devices": held_out, "fitted_on": sorted({r["devices"] for r in rows} - {held_out}),
                              "per_algorithm": held, "median_relative_error": statistics.median(every),
                              "worst_relative_error": max(every)}
    return record
