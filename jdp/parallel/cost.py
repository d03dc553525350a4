"""What each allreduce algorithm costs in the α–β–γ model, and the fit of α, β, γ to measured times.

One allreduce of N bytes per device on k devices takes

    t = m·α + b·β + r·γ

m the messages on the critical path (each pays a latency α), b the bytes the busiest device sends
(each takes β seconds, 1/bandwidth), r the bytes it adds (γ seconds each). Thakur, Rabenseifner &
Gropp (2005, §4) give these for MPICH's algorithms; Patarasuk & Yuan (2009) prove the ring's b is
the least any allreduce can send; NCCL's docs and nccl-tests' doc/PERFORMANCE.md use the ring's
2(k−1)/k factor for bus bandwidth. The counts below are what jdp's code sends
(`jdp.parallel.collectives`, `jdp.parallel.copies`), p the largest power of two ≤ k, e = [k > p]:

===================  ===========================  ==========================  ========================
strategy             m (sequential messages)      b (bytes sent per device)   r (bytes reduced)
===================  ===========================  ==========================  ========================
manual (star)        2(k−1)                       2(k−1)·N (the root)         (k−1)·N (the root)
manual_ring, ring    2(k−1)                       2(k−1)/k·N                  (k−1)/k·N
psum                 as ring (XLA's choice; an assumption the fit's residuals test)
tree                 2·log2(p) + 2e               2(p−1)/p·N + 2e·N           (p−1)/p·N + e·N
hierarchical (H×L)   intra: 2(L−1)                intra: 2(L−1)/L·N           (L−1)/L·N
                     inter: the outer strategy's m, b, r on H devices and N/L bytes
===================  ===========================  ==========================  ========================

Across nodes of L devices (numbered node by node) a flat ring's every step crosses between nodes
through one device of each node; the tree's steps at distance ≥ L cross with all L devices of a
node at once, 2(1 − L/p)·N of its bytes; the hierarchical allreduce's outer level has all L
devices of a node sending N/L-byte chunks at once. Devices sending at once share the node's NICs.

Wrappers change the counts: `+fused` sends one buffer (one set of m) instead of one per leaf,
`+buckets<M>MB` one per bucket of ≤ M MiB; a `+bfloat16-wire` ring sends half the bytes but adds
in float32 (b halves, r does not; in `hierarchical`, its outer ring's b only); `+bfloat16` casts
before the allreduce (b and r halve).

In every algorithm r = b/2, so γ and β cannot be told apart from one algorithm's times: the fit
keeps γ only if its column is independent of the others and folds it into β otherwise.

Simulated CPU devices have no links: every "transfer" is a copy in the one host's memory, which
all k devices share. There the right b is the bytes all devices send, which is 2(k−1)·N for
every flat algorithm (star, ring and tree alike), not the busiest device's: a `shared` `Link`.

References:
  Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", IJHPCA 2005.
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009.
  NVIDIA, nccl-tests doc/PERFORMANCE.md (bus bandwidth); NCCL user guide (ring and tree algorithms).
"""

import itertools
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from jdp.parallel.allreduce import HIERARCHICAL_NAME

_FLOAT32 = 4
_SMALL_DTYPES = {"bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Terms:
    """m, b, r of one allreduce on one link (see the module's table), and the bytes all devices send."""

    messages: float = 0.0
    bytes_sent: float = 0.0
    bytes_reduced: float = 0.0
    bytes_total: float = 0.0  # summed over the devices: what a link they all share carries
    concurrent: float = 1.0  # devices of a node sending across nodes at once, sharing its NICs

    def __add__(self, other: "Terms") -> "Terms":
        return Terms(self.messages + other.messages, self.bytes_sent + other.bytes_sent,
                     self.bytes_reduced + other.bytes_reduced, self.bytes_total + other.bytes_total,
                     max(self.concurrent, other.concurrent))


@dataclass(frozen=True)
class Link:
    """A link's latency α (seconds per message) and inverse bandwidth β (seconds per byte).

    `shared`: one medium that every device's bytes cross, like the memory of one host whose CPU
    devices are simulated; the bytes are then all devices' (2(k−1)·N for every flat algorithm),
    not the busiest device's. `ports`: a node's NICs of this kind; c devices sending across nodes
    at once share them, each at max(1, c / ports)·β.
    """

    alpha: float
    beta: float
    name: str = ""
    shared: bool = False
    ports: int = 1


def flat_terms(algorithm: str, k: int, nbytes: float) -> Terms:
    """m, b, r of `algorithm` (star, ring or tree) on k devices, N = `nbytes` per device."""
    if k <= 1 or nbytes <= 0:
        return Terms()
    total = 2 * (k - 1) * nbytes  # every flat algorithm: each device's N in, the sum out to the others
    if algorithm == "star":
        return Terms(2 * (k - 1), 2 * (k - 1) * nbytes, (k - 1) * nbytes, total)
    if algorithm == "ring":
        return Terms(2 * (k - 1), 2 * (k - 1) / k * nbytes, (k - 1) / k * nbytes, total)
    if algorithm == "tree":
        p = 1 << (k.bit_length() - 1)
        fold = 1 if k > p else 0  # the k − p extra devices send their buffer in, and get the sum back
        return Terms(2 * math.log2(p) + 2 * fold, 2 * (p - 1) / p * nbytes + 2 * fold * nbytes,
                     (p - 1) / p * nbytes + fold * nbytes, total)
    raise ValueError(f"no flat algorithm `{algorithm}`")


_FLAT = {"manual": "star", "manual_ring": "ring", "ring": "ring", "psum": "ring", "tree": "tree"}


@dataclass(frozen=True)
class Formula:
    """A strategy name read as its algorithm and wrappers: what `terms` computes from."""

    algorithm: str  # star, ring or tree; for hierarchical, the outer one
    hierarchical: bool = False
    wire_bytes: int = _FLOAT32  # the itemsize sent
    reduce_bytes: int = _FLOAT32  # the itemsize added
    fused: bool = False
    bucket_mb: float | None = None
    hosts: int | None = None  # hierarchical with its grouping in the name (`hierarchical:2x4`): H


def formula(name: str) -> Formula | None:
    """`ring+bfloat16-wire`, `tree+fused`, `hierarchical:tree`, … → its Formula; None if jdp has none
    (e.g. powersgd, or a plugin's strategy), so a caller can skip it."""
    base, *wrappers = name.split("+")
    hosts = None
    if hierarchical := HIERARCHICAL_NAME.fullmatch(base):
        algorithm = _FLAT[hierarchical["outer"] or "ring"]
        hosts = None if hierarchical["hosts"] is None else int(hierarchical["hosts"])
    else:
        algorithm = _FLAT.get(base)
    if algorithm is None:
        return None
    wire = reduce = _FLOAT32
    fused, bucket_mb = False, None
    for wrapper in wrappers:
        if wrapper == "fused":
            fused = True
        elif match := re.fullmatch(r"buckets([\d.]+)MB", wrapper):
            fused, bucket_mb = True, float(match.group(1))
        elif wrapper.endswith("-wire") and wrapper[:-5] in _SMALL_DTYPES:
            wire = _SMALL_DTYPES[wrapper[:-5]]
        elif wrapper in _SMALL_DTYPES:
            wire = reduce = _SMALL_DTYPES[wrapper]
        else:
            return None
    return Formula(algorithm, hierarchical is not None, wire, reduce, fused, bucket_mb, hosts)


def buffers(f: Formula, leaf_bytes: Sequence[float]) -> list[float]:
    """The float32 buffers the strategy allreduces: one per leaf, one in all (fused), or buckets."""
    if not f.fused:
        return [b for b in leaf_bytes if b > 0]
    total = float(sum(leaf_bytes))
    if f.bucket_mb is None:
        return [total] if total else []
    cap = f.bucket_mb * 2**20
    full, rest = divmod(total, cap)
    return [cap] * int(full) + ([rest] if rest else [])


def terms(name: str, k: int, leaf_bytes: Sequence[float] | float, per_node: int | None = None
          ) -> dict[str, Terms] | None:
    """m, b, r of strategy `name` on k devices, per link level ("intra" within a node, "inter" across).

    Args:
      name: a strategy name (see `formula`).
      k: devices.
      leaf_bytes: the float32 gradient's leaves in bytes (or one buffer's bytes).
      per_node: devices per node (L); None: all k on one node. A flat algorithm spanning nodes runs
        at the pace of its slowest link, the inter-node one; `hierarchical` needs k a multiple of L.

    Returns:
      {"intra": Terms, "inter": Terms}, or None if `name` has no formula.
    """
    f = formula(name)
    if f is None:
        return None
    leaves = [leaf_bytes] if isinstance(leaf_bytes, (int, float)) else list(leaf_bytes)
    local = min(k, per_node or k)
    intra, inter = Terms(), Terms()
    for nbytes in buffers(f, leaves):
        if f.hierarchical:
            if k % local:
                raise ValueError(f"hierarchical needs whole nodes: {k} devices, {local} per node")
            hosts = k // local  # H nodes' rings of L, then L outer allreduces of N/L over H devices
            inner = replace(f, wire_bytes=f.reduce_bytes)  # a wire dtype is the outer strategy's
            intra += _scaled(_times(flat_terms("ring", local, nbytes), hosts), inner)
            outer = _times(flat_terms(f.algorithm, hosts, nbytes / local), local)
            inter += _scaled(Terms(outer.messages, outer.bytes_sent, outer.bytes_reduced, outer.bytes_total, local), f)
        elif local == k:
            intra += _scaled(flat_terms(f.algorithm, k, nbytes), f)
        elif f.algorithm == "tree":
            near, far = _tree_across_nodes(k, local, nbytes)
            intra += _scaled(near, f)
            inter += _scaled(far, f)
        else:  # the ring (numbered node by node) and the star's root: one device of a node crosses at a time
            inter += _scaled(flat_terms(f.algorithm, k, nbytes), f)
    return {"intra": intra, "inter": inter}


def _tree_across_nodes(k: int, local: int, nbytes: float) -> tuple[Terms, Terms]:
    """Recursive halving/doubling over nodes of `local` devices numbered node by node.

    A step at distance d ≥ L pairs devices of different nodes, all L of a node at once: the first
    halving steps (and last doubling steps), which move the most bytes, 2(1 − L/p)·N; the fold
    of the k − p extra devices crosses nodes too. The steps at d < L stay within a node.
    """
    whole = flat_terms("tree", k, nbytes)
    p = 1 << (k.bit_length() - 1)
    if p % local:  # nodes not aligned with the exchange's halves: price every step across nodes
        return Terms(), Terms(whole.messages, whole.bytes_sent, whole.bytes_reduced, whole.bytes_total, local)
    near = Terms(2 * math.log2(local), 2 * (local - 1) / p * nbytes, (local - 1) / p * nbytes,
                 k * 2 * (local - 1) / p * nbytes)
    return near, Terms(whole.messages - near.messages, whole.bytes_sent - near.bytes_sent,
                       whole.bytes_reduced - near.bytes_reduced, whole.bytes_total - near.bytes_total, local)


def _times(t: Terms, groups: int) -> Terms:
    """`groups` copies of one group's allreduce running at once: the same critical path, more bytes in all."""
    return Terms(t.messages, t.bytes_sent, t.bytes_reduced, t.bytes_total * groups, t.concurrent)


def _scaled(t: Terms, f: Formula) -> Terms:
    """The float32 counts with the bytes sent and added in the strategy's own itemsizes."""
    wire = f.wire_bytes / _FLOAT32
    return Terms(t.messages, t.bytes_sent * wire, t.bytes_reduced * f.reduce_bytes / _FLOAT32, t.bytes_total * wire,
                 t.concurrent)


def seconds(levels: dict[str, Terms], intra: Link, inter: Link, gamma: float = 0.0) -> float:
    """The model's time for `terms`' output: each level on its own link, the additions at γ per byte."""
    total = 0.0
    for t, link in ((levels["intra"], intra), (levels["inter"], inter)):
        if link.shared:
            total += t.messages * link.alpha + t.bytes_total * link.beta + t.bytes_reduced * gamma
        else:
            beta = link.beta * max(1.0, t.concurrent / link.ports)
            total += t.messages * link.alpha + t.bytes_sent * beta + t.bytes_reduced * gamma
    return total


# --- the fit ------------------------------------------------------------------------------------


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


def features(row: dict, shared: bool = False) -> tuple[float, float, float] | None:
    """(m, b, r) of a `jdp bench allreduce` row, all levels on the one link measured; None if no formula.

    With `shared`, b is the bytes all devices send (see `Link`). A hierarchical row needs `hosts`
    (H), or a name with its grouping (`hierarchical:2x4`), to split its k devices into H × k/H.
    """
    name, k = row["algorithm"], row["devices"]
    f = formula(name)
    hosts = None if f is None else f.hosts or row.get("hosts")
    if f is None or (f.hierarchical and hosts is None):
        return None
    per_node = k // hosts if f.hierarchical else None
    levels = terms(name, k, row["size_bytes"], per_node)
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

    Algorithms with no formula (or too few rows) are skipped with one line through `say`.

    Returns:
      {"algorithms": {name: fit}, "held_out": None or {"devices", "per_algorithm": {name: {median, worst,
      errors}}, "median_relative_error", "worst_relative_error"}}.
    """
    by_name: dict[str, list[dict]] = {}
    for r in rows:  # one fit for a hierarchical algorithm over its groupings (`hierarchical:2x2`, `:2x4`, ...)
        by_name.setdefault(re.sub(r":\d+x\d+", "", r["algorithm"]), []).append(r)
    fits, held = {}, {}
    for name, mine in by_name.items():
        if features(mine[0]) is None:
            why = ("its rows do not say how many hosts (`hosts`) its devices are on" if formula(name)
                   else "no cost formula for it in jdp.parallel.cost")
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
