"""The registry of allreduce strategies: what `jdp train --allreduce NAME` and the benches look up.

The algorithms live by where they run: `jdp.parallel.collectives` (inside the mapped step) and
`jdp.parallel.copies` (outside it, explicit copies); the strategy type and its capabilities in
`jdp.parallel.strategy`; fusion into few large buffers in `jdp.parallel.buckets`.
"""

from functools import partial

import jax.numpy as jnp

from jdp.errors import ConfigError
from jdp.parallel import collectives, copies
from jdp.parallel.buckets import fused
from jdp.parallel.strategy import Allreduce, check


def _ring_wire(dtype: jnp.dtype) -> Allreduce:
    """jdp's ring sending every chunk in `dtype`, adding in the buffer's own dtype at every hop."""
    return Allreduce(f"ring+{jnp.dtype(dtype).name}-wire", partial(collectives.ring, wire=dtype))


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
      name: a registered name (see `names`), or a strategy object.
      fuse: allreduce few large buffers instead of one per leaf (see `fused`).
      bucket_mb: with `fuse`, the largest bucket in MB; None means one buffer per dtype.

    Raises:
      ConfigError: for an unknown name (listing the known ones), or `bucket_mb` without `fuse`.
    """
    if isinstance(name, Allreduce):
        strategy = check(name)
    elif name in _STRATEGIES:
        strategy = _STRATEGIES[name]
    else:
        raise ConfigError(
            f"Unknown allreduce strategy `{name}`; choose one of: {', '.join(_STRATEGIES)} "
            "(or register your own with `jdp.register_allreduce`, loaded with `--plugin MODULE`)."
        )
    if not fuse:
        if bucket_mb is not None:
            raise ConfigError(f"`bucket_mb={bucket_mb:g}` only applies to fused buffers; add `fuse=True`.")
        return strategy
    return fused(strategy, bucket_mb)
