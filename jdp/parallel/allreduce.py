"""The registry of allreduce strategies: what `jdp train --allreduce NAME`, `jdp predict` and the benches look up.

The one place that reads a strategy's name: `get` turns a registered name, a hierarchical one with
its grouping, or either followed by the wrappers as jdp writes them (`ring+bfloat16-wire+fused`)
into the strategy value, and the rest of jdp reads that value's capabilities. The algorithms live
by where they run: `jdp.parallel.collectives` (inside the mapped step) and
`jdp.parallel.transfers` (outside it, explicit copies); the strategy type and its capabilities in
`jdp.parallel.strategy`; their costs in `jdp.parallel.cost`; the wrappers in `jdp.parallel.buckets`
(fusion) and `jdp.parallel.compress` (casts, PowerSGD).
"""

import re
from functools import partial

import jax.numpy as jnp

from jdp.errors import Arg, ConfigError, check_positive
from jdp.parallel import collectives, cost, transfers
from jdp.parallel import compress as compress_lib
from jdp.parallel.buckets import fused
from jdp.parallel.strategy import Allreduce, check

_FLOAT32 = 4  # the gradients' itemsize: a wire's bytes are its dtype's share of it


_RING_COST = cost.flat("ring", "ring", ppermutes=True, swap_piece_bytes=collectives.SWAP_PIECE_BYTES)


def _ring_wire(dtype: jnp.dtype) -> Allreduce:
    """jdp's ring sending every chunk in `dtype`, adding in the buffer's own dtype at every hop."""
    return Allreduce(f"ring+{jnp.dtype(dtype).name}-wire", partial(collectives.ring, wire=dtype),
                     cost=cost.wire_cost(_RING_COST, jnp.dtype(dtype).itemsize / _FLOAT32))


OUTER = ("ring", "tree", "psum")  # what a hierarchical allreduce may run across hosts
HIERARCHICAL_NAME = re.compile(  # hierarchical[:outer][:HxL], see `hierarchical`
    r"hierarchical(?::(?P<outer>ring|tree|psum))?(?::(?P<hosts>\d+)x(?P<local>\d+))?")


def hierarchical(outer: str = "ring", shape: tuple[int, int] | None = None) -> Allreduce:
    """The two-level allreduce (`collectives.hierarchical`) with `outer` across hosts, as a strategy.

    Named `hierarchical[:OUTER][:HxL]` (`:ring` and the grouping left out when they are the
    defaults), the name `get` parses back. With outer "ring" it has halves (`--shard-optimizer`)
    and a low-precision wire, used across hosts only: `--compress bf16-wire` halves the bytes on
    the slow links.

    Args:
      outer: "ring", "tree" or "psum".
      shape: (H hosts, L local devices); None: one host per process.

    Raises:
      ConfigError: for an unknown `outer` or a grouping that is not positive.
    """
    if outer not in OUTER:
        raise ConfigError(f"`outer={outer}` is not an algorithm across hosts; choose one of: {', '.join(OUTER)}.")
    if shape is not None:
        check_positive("hosts", shape[0])
        check_positive("local_devices", shape[1])
    family = "hierarchical" + ("" if outer == "ring" else f":{outer}")  # what the fit keys it by, any grouping
    name = family + ("" if shape is None else ":{}x{}".format(*shape))
    priced = cost.hierarchical("tree" if outer == "tree" else "ring", shape, family,  # psum: priced as a ring
                               ppermutes=outer != "psum",
                               swap_piece_bytes=None if outer == "psum" else collectives.SWAP_PIECE_BYTES)

    def wire(dtype: jnp.dtype) -> Allreduce:
        return Allreduce(f"{name}+{jnp.dtype(dtype).name}-wire",
                         partial(collectives.hierarchical, outer="ring", shape=shape, wire=dtype),
                         cost=cost.wire_cost(priced, jnp.dtype(dtype).itemsize / _FLOAT32, levels=("inter",)))

    if outer != "ring":
        return Allreduce(name, partial(collectives.hierarchical, outer=outer, shape=shape), cost=priced)
    return Allreduce(name, partial(collectives.hierarchical, outer=outer, shape=shape), wire=wire, cost=priced,
                     reduce_scatter=partial(collectives.hierarchical_reduce_scatter, shape=shape),
                     all_gather=partial(collectives.hierarchical_all_gather, shape=shape))


_STRATEGIES: dict[str, Allreduce] = {  # built-ins first, then what users register
    "psum": Allreduce("psum", collectives.psum, reduce_scatter=collectives.psum_scatter,
                      all_gather=collectives.all_gather,
                      # XLA's algorithm (a ring: an assumption the fit's residuals test), and its all-reduce
                      # combiner merges a step's psums into one: priced as one buffer of the leaves
                      cost=cost.fused_cost(cost.flat("ring", "psum"), None)),
    "manual": Allreduce("manual", transfers.manual, "outside", reduce_scatter=transfers.manual_reduce_scatter,
                        all_gather=transfers.manual_all_gather, cost=cost.flat("star", "manual")),
    "manual_ring": Allreduce("manual_ring", transfers.manual_ring, "outside",
                             reduce_scatter=transfers.manual_ring_reduce_scatter,
                             all_gather=transfers.manual_ring_all_gather, cost=cost.flat("ring", "manual_ring")),
    "ring": Allreduce("ring", collectives.ring, reduce_scatter=collectives.ring_reduce_scatter,
                      all_gather=collectives.ring_all_gather, wire=_ring_wire, cost=_RING_COST),
    "tree": Allreduce("tree", collectives.tree,
                      cost=cost.flat("tree", "tree", ppermutes=True, swap_piece_bytes=collectives.SWAP_PIECE_BYTES)),
    "hierarchical": hierarchical("ring"),
    "hierarchical:tree": hierarchical("tree"),
}


def register(strategy: Allreduce, *, replace: bool = False) -> Allreduce:
    """Makes `strategy` available by name to `get`, `jdp train --allreduce`, `jdp predict` and the benches.

    Check it first with `jdp.testing.check_allreduce(strategy)`. A cost that names no fitted
    algorithm (`Cost.fits`) is fitted under the strategy's name (`jdp bench allreduce --fit`).

    Returns:
      The strategy as registered.

    Raises:
      ConfigError: if it is not a well-formed `Allreduce`, or its name is taken (unless `replace`).
    """
    check(strategy)
    if strategy.name in _STRATEGIES and not replace:
        raise ConfigError(f"An allreduce strategy named `{strategy.name}` is registered already; pass `replace=True`.")
    if strategy.cost is not None and not strategy.cost.fits:
        strategy = strategy._replace(cost=strategy.cost._replace(fits=(strategy.name,)))
    _STRATEGIES[strategy.name] = strategy
    return strategy


def names(where: str | None = None, *, halves: bool = False, wire: bool = False) -> tuple[str, ...]:
    """The registered strategies' names, built-ins first: those of one `where` if given, those with
    a reduce-scatter and all-gather if `halves`, those with a low-precision wire if `wire`."""
    return tuple(name for name, s in _STRATEGIES.items()
                 if where in (None, s.where) and (s.has_halves or not halves) and (s.wire is not None or not wire))


WRAPPER_NAME = re.compile(  # what a wrapper appends to a name: see `_wrapped`
    r"fused|buckets(?P<bucket_mb>[\d.]+)MB|(?P<wire>bfloat16|float16)-wire|(?P<cast>bfloat16|float16)"
    r"|powersgd(?P<rank>\d+)")
_CASTS = {"bfloat16": "bf16", "float16": "fp16"}  # a dtype's name → its `compress` mode


def get(name: str | Allreduce, *, fuse: bool = False, bucket_mb: float | None = None, compress: str = "none",
        rank: int | None = None) -> Allreduce:
    """The strategy `name` (or `name` itself if it is an `Allreduce`): sending in a low dtype if a `-wire`
    mode asks, fused if asked, then compressed. The one lookup of a strategy.

    Args:
      name: a registered name (see `names`); a hierarchical one with its grouping, e.g.
        `hierarchical:tree:2x4` (2 hosts × 4 local devices; `hierarchical`); either followed by
        wrappers as jdp names them (`ring+bfloat16-wire+fused`, `tree+buckets25MB`, `psum+bfloat16`,
        `ring+powersgd2`); or a strategy object.
      fuse: allreduce few large buffers instead of one per leaf (see `fused`).
      bucket_mb: with `fuse`, the largest bucket in MB; None means one buffer per dtype.
      compress: a mode of `jdp.parallel.compress.MODES`.
      rank: with `compress="powersgd"`, its rank (None: 1).

    Raises:
      ConfigError: for an unknown name (listing the known ones), `bucket_mb` without `fuse`, an unknown
        mode, a `-wire` mode on a strategy without a low-precision wire (`Allreduce.wire`), or a bad rank.
    """
    compress_lib.check_mode(compress, rank)
    strategy = check(name) if isinstance(name, Allreduce) else _named(name)
    if compress.endswith("-wire"):
        strategy = _on_wire(strategy, compress_lib.DTYPES[compress[:4]], compress)
    if fuse:
        strategy = fused(strategy, bucket_mb)
    elif bucket_mb is not None:
        raise ConfigError(Arg("bucket_mb", f"{bucket_mb:g}"), " only applies to fused buffers; add ",
                          Arg("fuse", True), ".")
    return compress_lib.compressed(strategy, compress, rank)


def _named(name: str) -> Allreduce:
    """The strategy a name spells: a registered or hierarchical base, then each `+wrapper` applied in order."""
    base, *wrappers = name.split("+")
    if base in _STRATEGIES:
        strategy = _STRATEGIES[base]
    elif match := HIERARCHICAL_NAME.fullmatch(base):
        shape = None if match["hosts"] is None else (int(match["hosts"]), int(match["local"]))
        strategy = hierarchical(match["outer"] or "ring", shape)
    else:
        raise ConfigError(
            f"Unknown allreduce strategy `{name}`; choose one of: {', '.join(_STRATEGIES)}, "
            "hierarchical[:ring|tree|psum][:HxL] (or register your own with `jdp.register_allreduce`, "
            "loaded with `--plugin MODULE`), followed by wrappers if any: +fused, +buckets<M>MB, "
            "+bfloat16-wire, +bfloat16, +powersgd<R>."
        )
    for wrapper in wrappers:
        strategy = _wrapped(strategy, wrapper, name)
    return strategy


def _wrapped(strategy: Allreduce, wrapper: str, name: str) -> Allreduce:
    """`strategy` with the wrapper a name appends (`fused`, `buckets25MB`, `bfloat16-wire`, `bfloat16`, `powersgd2`)."""
    match = WRAPPER_NAME.fullmatch(wrapper)
    if match is None:
        raise ConfigError(f"`{name}` has `+{wrapper}`, not a wrapper jdp writes: +fused, +buckets<M>MB, "
                          "+bfloat16-wire, +float16-wire, +bfloat16, +float16, +powersgd<R>.")
    if match["bucket_mb"] is not None or wrapper == "fused":
        return fused(strategy, None if match["bucket_mb"] is None else float(match["bucket_mb"]))
    if match["wire"] is not None:
        return _on_wire(strategy, jnp.dtype(match["wire"]), f"{_CASTS[match['wire']]}-wire")
    if match["cast"] is not None:
        return compress_lib.compressed(strategy, _CASTS[match["cast"]])
    return compress_lib.compressed(strategy, "powersgd", int(match["rank"]))


def _on_wire(strategy: Allreduce, dtype: jnp.dtype, mode: str) -> Allreduce:
    """`strategy.wire(dtype)`, or a ConfigError naming the strategies that have a low-precision wire."""
    if strategy.wire is None:
        wired = ", ".join(names(wire=True))
        raise ConfigError(
            Arg("compress", mode), " sends low precision and adds in float32 at each hop of a strategy that can "
            "(`Allreduce.wire`); use ", Arg("allreduce", wired), ", or ", Arg("compress", mode[:4]),
            " to cast for any strategy."
        )
    return strategy.wire(dtype)._replace(payload=compress_lib.cast_to(dtype))  # the float32 chunks, cast
