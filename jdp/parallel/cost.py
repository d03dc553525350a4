"""What each allreduce algorithm costs in the α–β–γ model (fitted to measured times by `jdp.bench.fit`).

One allreduce of N bytes per device on k devices takes

    t = m·α + b·β + r·γ

m the messages on the critical path (each pays a latency α), b the bytes the busiest device sends
(each takes β seconds, 1/bandwidth), r the bytes it adds (γ seconds each). Thakur, Rabenseifner &
Gropp (2005, §4) give these for MPICH's algorithms; Patarasuk & Yuan (2009) prove the ring's b is
the least any allreduce can send; NCCL's docs and nccl-tests' doc/PERFORMANCE.md use the ring's
2(k−1)/k factor for bus bandwidth. The counts below are what jdp's code sends
(`jdp.parallel.collectives`, `jdp.parallel.transfers`), p the largest power of two ≤ k, e = [k > p]:

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

Wrappers change the counts: `fused` sends one buffer (one set of m) instead of one per leaf, or
one per bucket of ≤ M MiB; a low-precision wire (`Allreduce.wire`, `+bfloat16-wire`) sends half
the bytes but adds in float32 (b halves, r does not; in `hierarchical`, its outer ring's b only);
a cast (`low_precision`, `+bfloat16`) hands the strategy half the bytes (b and r halve).

A cost is a capability of the strategy value (`Allreduce.cost`, a `Cost`), built here for jdp's
algorithms and transformed by each wrapper, so `jdp predict` and the fit price any strategy,
one a plugin registered included, without reading its name.

Simulated CPU devices have no links: every "transfer" is a copy in the one host's memory, which
all k devices share. There the right b is the bytes all devices send, which is 2(k−1)·N for
every flat algorithm (star, ring and tree alike), not the busiest device's: a `shared` `Link`.

References:
  Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", IJHPCA 2005.
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009.
  NVIDIA, nccl-tests doc/PERFORMANCE.md (bus bandwidth); NCCL user guide (ring and tree algorithms).
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

Levels = dict[str, "Terms"]  # {"intra": within a node, "inter": across nodes}


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

    def scaled(self, sent: float = 1.0, concurrent: float | None = None) -> "Terms":
        """The same messages and additions with the bytes sent (and carried in all) × `sent`; `concurrent` if given."""
        return Terms(self.messages, self.bytes_sent * sent, self.bytes_reduced, self.bytes_total * sent,
                     self.concurrent if concurrent is None else concurrent)


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


class Cost(NamedTuple):
    """What one allreduce of a strategy costs: a capability of the strategy (`jdp.Allreduce.cost`).

    Attributes:
      terms: `terms(k, leaf_bytes, per_node) -> {"intra": Terms, "inter": Terms}` for k devices, the
        buffers the strategy is handed (bytes per device, one per leaf), and L = `per_node` devices
        per node (None: no grouping given, all k on one node for a flat algorithm). None where the
        strategy cannot be priced so: one that needs a grouping (`hierarchical`) without one, or k
        not a whole number of its groups.
      fits: the algorithms whose fitted α, β, γ (`jdp bench allreduce --fit`) price it, in order of
        preference: its own first (wrappers keep it), then a stand-in where a sweep did not time it;
        () for none (then only a cluster preset prices it).
      exchange: `exchange(k, per_node)`, the members of the ring of `ppermute`s whose messages cross
        between nodes (k for a flat ring or tree, the H nodes for hierarchical's outer ring); None for
        a collective of XLA's own (`psum`, all-gather), which its transport runs (see `jdp.bench.nic_model`).
      swap_piece_bytes: the largest piece of a swap between processes, each piece a message (jdp's ring and
        tree, `jdp.parallel.collectives.swap_in_pieces`); None: sent whole. The NIC model prices the pieces of
        an exchange with two members (`jdp.bench.nic_model`).
    """

    terms: Callable[[int, Sequence[float], int | None], Levels | None]
    fits: tuple[str, ...] = ()
    exchange: Callable[[int, int], int] | None = None
    swap_piece_bytes: int | None = None


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


def flat(algorithm: str, name: str, ppermutes: bool = False, swap_piece_bytes: int | None = None) -> Cost:
    """The cost of a flat algorithm ("star", "ring" or "tree") run once per buffer, fitted as `name`;
    `ppermutes`: made of `ppermute`s over all k devices (`Cost.exchange`), a swap of two in pieces of at most
    `swap_piece_bytes` (`Cost.swap_piece_bytes`).

    Spanning nodes of L devices (numbered node by node), the ring and the star's root cross
    between nodes through one device of a node at a time, all at the inter-node link's pace; the
    tree's steps at distance ≥ L cross with all L devices of a node at once (`_tree_across_nodes`).
    """

    def terms(k: int, leaf_bytes: Sequence[float], per_node: int | None) -> Levels:
        local = min(k, per_node or k)
        intra, inter = Terms(), Terms()
        for nbytes in leaf_bytes:
            if nbytes <= 0:
                continue
            if local == k:
                intra += flat_terms(algorithm, k, nbytes)
            elif algorithm == "tree":
                near, far = _tree_across_nodes(k, local, nbytes)
                intra, inter = intra + near, inter + far
            else:
                inter += flat_terms(algorithm, k, nbytes)
        return {"intra": intra, "inter": inter}

    return Cost(terms, (name,), (lambda k, per_node: k) if ppermutes else None, swap_piece_bytes)


def hierarchical(outer: str, shape: tuple[int, int] | None, name: str, ppermutes: bool = True,
                 swap_piece_bytes: int | None = None) -> Cost:
    """The two-level allreduce's cost: rings of L within each node, then `outer` ("ring" or "tree")
    over the H nodes on N/L-byte chunks, all L devices of a node at once.

    L is `shape`'s (H, L) if given (k must then be H·L), else the caller's `per_node`; without
    either it cannot be priced (None). Fitted as `name`, else as the ring. `ppermutes`: the outer
    level is made of `ppermute`s over the H nodes (`Cost.exchange`; a swap of two nodes in pieces of at most
    `swap_piece_bytes`); otherwise it is XLA's psum, whose all-reduce combiner merges a step's outer sums into
    one (priced as one chunk of the leaves).
    """

    def terms(k: int, leaf_bytes: Sequence[float], per_node: int | None) -> Levels | None:
        if shape is not None:
            if shape[0] * shape[1] != k:
                return None
            per_node = shape[1]
        if per_node is None:
            return None
        local = min(k, per_node)
        if k % local:
            return None
        hosts = k // local
        intra, inter = Terms(), Terms()
        for nbytes in filter(lambda b: b > 0, leaf_bytes):
            intra += _times(flat_terms("ring", local, nbytes), hosts)
        for nbytes in filter(lambda b: b > 0, leaf_bytes if ppermutes else [sum(leaf_bytes)]):
            inter += _times(flat_terms(outer, hosts, nbytes / local), local).scaled(concurrent=local)
        return {"intra": intra, "inter": inter}

    return Cost(terms, (name, "ring"), (lambda k, per_node: k // per_node) if ppermutes else None, swap_piece_bytes)


def fused_cost(cost: Cost, bucket_mb: float | None) -> Cost:
    """`cost` of the leaves raveled into one buffer, or buckets of at most `bucket_mb` MiB (`jdp.fused`)."""

    def buffers(leaf_bytes: Sequence[float]) -> list[float]:
        total = float(sum(leaf_bytes))
        if bucket_mb is None:
            return [total] if total else []
        cap = bucket_mb * 2**20
        full, rest = divmod(total, cap)
        return [cap] * int(full) + ([rest] if rest else [])

    return cost._replace(terms=lambda k, leaf_bytes, per_node: cost.terms(k, buffers(leaf_bytes), per_node))


def cast_cost(cost: Cost, ratio: float) -> Cost:
    """`cost` of buffers cast before the allreduce to `ratio` of their bytes (`jdp.low_precision`)."""
    return cost._replace(terms=lambda k, leaf_bytes, per_node: cost.terms(k, [b * ratio for b in leaf_bytes], per_node))


def wire_cost(cost: Cost, ratio: float, levels: Sequence[str] = ("intra", "inter")) -> Cost:
    """`cost` with every message on `levels` sent in `ratio` of its bytes, the additions in the buffer's
    own dtype (`Allreduce.wire`): b scales, r does not."""

    def terms(k: int, leaf_bytes: Sequence[float], per_node: int | None) -> Levels | None:
        full = cost.terms(k, leaf_bytes, per_node)
        if full is None:
            return None
        return {level: t.scaled(sent=ratio) if level in levels else t for level, t in full.items()}

    return cost._replace(terms=terms)


def _tree_across_nodes(k: int, local: int, nbytes: float) -> tuple[Terms, Terms]:
    """Recursive halving/doubling over nodes of `local` devices numbered node by node.

    A step at distance d ≥ L pairs devices of different nodes, all L of a node at once: the first
    halving steps (and last doubling steps), which move the most bytes, 2(1 − L/p)·N; the fold
    of the k − p extra devices crosses nodes too. The steps at d < L stay within a node.
    """
    whole = flat_terms("tree", k, nbytes)
    p = 1 << (k.bit_length() - 1)
    if p % local:  # nodes not aligned with the exchange's halves: price every step across nodes
        return Terms(), whole.scaled(concurrent=local)
    near = Terms(2 * math.log2(local), 2 * (local - 1) / p * nbytes, (local - 1) / p * nbytes,
                 k * 2 * (local - 1) / p * nbytes)
    return near, Terms(whole.messages - near.messages, whole.bytes_sent - near.bytes_sent,
                       whole.bytes_reduced - near.bytes_reduced, whole.bytes_total - near.bytes_total, local)


def _times(t: Terms, groups: int) -> Terms:
    """`groups` copies of one group's allreduce running at once: the same critical path, more bytes in all."""
    return Terms(t.messages, t.bytes_sent, t.bytes_reduced, t.bytes_total * groups, t.concurrent)


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


_MOVED = {"formula": "`jdp.get_allreduce(name).cost`", "terms": "`jdp.get_allreduce(name).cost.terms(k, leaf_bytes, "
          "per_node)`", **{name: f"`jdp.bench.fit.{name}`" for name in ("nnls", "features", "fit", "predict_us", "fit_all")}}


def __getattr__(name: str):
    if name in _MOVED:  # removed after 0.1.0; see docs/api.md
        raise AttributeError(f"`jdp.parallel.cost.{name}` is now {_MOVED[name]}: a strategy carries its own cost.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def gathered(ratio: float, name: str) -> Cost:
    """The cost of an allreduce by all-gather (`jdp.parallel.compress.quantized`): each device sends its
    leaves in one buffer, cast to `ratio` of their bytes, to each of the k − 1 others (a ring of k − 1
    steps), then adds the k buffers itself (the scales' own gather, a few bytes, is not counted). Across
    nodes every step crosses between them. Fitted as `name`, else as the ring."""

    def terms(k: int, leaf_bytes: Sequence[float], per_node: int | None) -> Levels:
        nbytes = float(sum(leaf_bytes))
        one = Terms(k - 1, (k - 1) * nbytes * ratio, (k - 1) * nbytes, k * (k - 1) * nbytes * ratio) \
            if k > 1 and nbytes > 0 else Terms()
        return {"intra": one, "inter": Terms()} if min(k, per_node or k) == k else {"intra": Terms(), "inter": one}

    return Cost(terms, (name, "ring"))

