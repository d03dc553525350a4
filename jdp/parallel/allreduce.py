"""The registry of allreduce strategies: what `jdp train --allreduce NAME` and the benches look up.

The algorithms live by where they run: `jdp.parallel.collectives` (inside the mapped step) and
`jdp.parallel.copies` (outside it, explicit copies); the strategy type and its capabilities in
`jdp.parallel.strategy`; fusion into few large buffers in `jdp.parallel.buckets`.
"""

import re
from functools import partial

import jax.numpy as jnp

from jdp.errors import ConfigError, check_positive
from jdp.parallel import collectives, copies
from jdp.parallel.buckets import fused
from jdp.parallel.strategy import Allreduce, check


def _ring_wire(dtype: jnp.dtype) -> Allreduce:
    """jdp's ring sending every chunk in `dtype`, adding in the buffer's own dtype at every hop."""
    return Allreduce(f"ring+{jnp.dtype(dtype).name}-wire", partial(collectives.ring, wire=dtype))


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
    name = "hierarchical" + ("" if outer == "ring" else f":{outer}") + ("" if shape is None else ":{}x{}".format(*shape))

    def wire(dtype: jnp.dtype) -> Allreduce:
        return Allreduce(f"{name}+{jnp.dtype(dtype).name}-wire",
                         partial(collectives.hierarchical, outer="ring", shape=shape, wire=dtype))

    if outer != "ring":
        return Allreduce(name, partial(collectives.hierarchical, outer=outer, shape=shape))
    return Allreduce(name, partial(collectives.hierarchical, outer=outer, shape=shape), wire=wire,
                     reduce_scatter=partial(collectives.hierarchical_reduce_scatter, shape=shape),
                     all_gather=partial(collectives.hierarchical_all_gather, shape=shape))


_STRATEGIES: dict[str, Allreduce] = {  # built-ins first, then what users register
    "psum": Allreduce("psum", collectives.psum, reduce_scatter=collectives.psum_scatter,
                      all_gather=collectives.all_gather),
    "manual": Allreduce("manual", copies.manual, "outside", reduce_scatter=copies.manual_reduce_scatter,
                        all_gather=copies.manual_all_gather),
    "manual_ring": Allreduce("manual_ring", copies.manual_ring, "outside",
                             reduce_scatter=copies.manual_ring_reduce_scatter,
                             all_gather=copies.manual_ring_all_gather),
    "ring": Allreduce("ring", collectives.ring, reduce_scatter=collectives.ring_reduce_scatter,
                      all_gather=collectives.ring_all_gather, wire=_ring_wire),
    "tree": Allreduce("tree", collectives.tree),
    "hierarchical": hierarchical("ring"),
    "hierarchical:tree": hierarchical("tree"),
}


def register(strategy: Allreduce, *, replace: bool = False) -> Allreduce:
    """Makes `strategy` available by name to `get`, `jdp train --allreduce` and the benches.

    Check it first with `jdp.testing.check_allreduce(strategy)`.

    Raises:
      ConfigError: if it is not a well-formed `Allreduce`, or its name is taken (unless `replace`).
    """
    check(strategy)
    if strategy.name in _STRATEGIES and not replace:
        raise ConfigError(f"An allreduce strategy named `{strategy.name}` is registered already; pass `replace=True`.")
    _STRATEGIES[strategy.name] = strategy
    return strategy


def names(where: str | None = None, *, halves: bool = False) -> tuple[str, ...]:
    """The registered strategies' names, built-ins first: those of one `where` if given, those with
    a reduce-scatter and all-gather if `halves`."""
    return tuple(name for name, s in _STRATEGIES.items()
                 if where in (None, s.where) and (s.has_halves or not halves))


def get(name: str | Allreduce, *, fuse: bool = False, bucket_mb: float | None = None) -> Allreduce:
    """The strategy called `name` (or `name` itself if it is an `Allreduce`), per leaf or fused.

    Args:
      name: a registered name (see `names`), a hierarchical one with its grouping, e.g.
        `hierarchical:tree:2x4` (2 hosts × 4 local devices; `jdp.parallel.allreduce.hierarchical`),
        or a strategy object.
      fuse: allreduce few large buffers instead of one per leaf (see `fused`).
      bucket_mb: with `fuse`, the largest bucket in MB; None means one buffer per dtype.

    Raises:
      ConfigError: for an unknown name (listing the known ones), or `bucket_mb` without `fuse`.
    """
    if isinstance(name, Allreduce):
        strategy = check(name)
    elif name in _STRATEGIES:
        strategy = _STRATEGIES[name]
    elif match := HIERARCHICAL_NAME.fullmatch(name):
        shape = None if match["hosts"] is None else (int(match["hosts"]), int(match["local"]))
        strategy = hierarchical(match["outer"] or "ring", shape)
    else:
        raise ConfigError(
            f"Unknown allreduce strategy `{name}`; choose one of: {', '.join(_STRATEGIES)}, "
            "hierarchical[:ring|tree|psum][:HxL] (or register your own with `jdp.register_allreduce`, "
            "loaded with `--plugin MODULE`)."
        )
    if not fuse:
        if bucket_mb is not None:
            raise ConfigError(f"`bucket_mb={bucket_mb:g}` only applies to fused buffers; add `fuse=True`.")
        return strategy
    return fused(strategy, bucket_mb)
