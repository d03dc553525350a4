"""Gradient buffers: a pytree raveled into one flat buffer per dtype, cut into buckets or k slices.

Two users: `fused` allreduces few large buffers instead of one small buffer per leaf, and the
sharded optimizer (`jdp.parallel.step`, `jdp.parallel.opt_state`) reduce-scatters each dtype's
buffer padded to k equal slices (`Flat`). Leaves are grouped by dtype, so nothing is cast.
"""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp.errors import Arg, ConfigError
from jdp.parallel.cost import fused_cost
from jdp.parallel.strategy import Allreduce
from jdp.types import PyTree

# For each dtype in order of first appearance: (dtype, ((leaf index, shape after the lead axes), ...)).
Layout = tuple[tuple[np.dtype, tuple[tuple[int, tuple[int, ...]], ...]], ...]


def layout_of(leaves: Sequence[jax.Array], lead: int) -> Layout:
    """Which leaves go into which dtype's buffer, in order; hashable, so it can be a static argument."""
    groups: dict[np.dtype, list[tuple[int, tuple[int, ...]]]] = {}
    for index, leaf in enumerate(leaves):
        groups.setdefault(np.dtype(leaf.dtype), []).append((index, tuple(leaf.shape[lead:])))
    return tuple((dtype, tuple(entries)) for dtype, entries in groups.items())


def _bounds(size: int, itemsize: int, cap_bytes: float | None) -> list[tuple[int, int]]:
    """[start, stop) of consecutive buckets of at most `cap_bytes` (at least one element each)."""
    if cap_bytes is None or size == 0:
        return [(0, size)]
    step = max(1, int(cap_bytes // itemsize))
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def to_buckets(leaves: Sequence[jax.Array], layout: Layout, cap_bytes: float | None, lead: int) -> list[jax.Array]:
    """Ravels the leaves (keeping the first `lead` axes) into each dtype's buffer, cut into buckets."""
    buckets = []
    for dtype, entries in layout:
        head = leaves[entries[0][0]].shape[:lead]
        buffer = jnp.concatenate([leaves[i].reshape(*head, -1) for i, _ in entries], axis=lead)
        for start, stop in _bounds(buffer.shape[lead], dtype.itemsize, cap_bytes):
            buckets.append(lax.slice_in_dim(buffer, start, stop, axis=lead))
    return buckets


def from_buckets(buckets: Sequence[jax.Array], layout: Layout, cap_bytes: float | None, lead: int) -> list[jax.Array]:
    """The inverse of `to_buckets`: the leaves in their original order and shapes."""
    leaves: dict[int, jax.Array] = {}
    remaining = iter(buckets)
    for dtype, entries in layout:
        size = sum(math.prod(shape) for _, shape in entries)
        parts = [next(remaining) for _ in _bounds(size, dtype.itemsize, cap_bytes)]
        buffer = jnp.concatenate(parts, axis=lead) if len(parts) > 1 else parts[0]
        head, offset = buffer.shape[:lead], 0
        for index, shape in entries:
            stop = offset + math.prod(shape)
            leaves[index] = lax.slice_in_dim(buffer, offset, stop, axis=lead).reshape(*head, *shape)
            offset = stop
    return [leaves[i] for i in range(len(leaves))]


_to_buckets_jit = jax.jit(to_buckets, static_argnums=(1, 2, 3))
_from_buckets_jit = jax.jit(from_buckets, static_argnums=(1, 2, 3))


def fused(strategy: Allreduce, bucket_mb: float | None = None) -> Allreduce:
    """Wraps `strategy` to allreduce the leaves raveled into one buffer per dtype, or buckets.

    Many small allreduces pay a fixed cost (a collective's latency, or a host dispatch per copy)
    for every leaf; one large buffer pays it once. Buckets of at most `bucket_mb` MB (2^20 bytes,
    like PyTorch DDP's `bucket_cap_mb` and Horovod's tensor fusion threshold) bound the extra
    memory. The sums stay those of `strategy`; the fused strategy has no halves (the sharded
    optimizer ravels the gradients itself) and no state; its cost is the strategy's on the buffers.

    Args:
      strategy: any stateless allreduce strategy.
      bucket_mb: largest bucket in MB; None puts each dtype's leaves in one buffer.

    Returns:
      The fused strategy, named `<name>+fused` or `<name>+buckets<M>MB`.

    Raises:
      ConfigError: if `bucket_mb` is not positive.
    """
    if bucket_mb is not None and not bucket_mb > 0:
        raise ConfigError(Arg("bucket_mb"), f" must be positive, got {bucket_mb}.")
    cap_bytes = None if bucket_mb is None else bucket_mb * 2**20
    name = f"{strategy.name}+fused" if bucket_mb is None else f"{strategy.name}+buckets{bucket_mb:g}MB"
    cost = None if strategy.cost is None else fused_cost(strategy.cost, bucket_mb)

    def fn(tree: PyTree, *axis: str) -> PyTree:
        leaves, treedef = jax.tree.flatten(tree)
        layout = layout_of(leaves, strategy.lead)
        buckets = _to_buckets_jit(leaves, layout, cap_bytes, strategy.lead)  # outside: one dispatch, slices stay put
        reduced = strategy.fn(buckets, *axis)
        return jax.tree.unflatten(treedef, _from_buckets_jit(reduced, layout, cap_bytes, strategy.lead))

    return strategy.wrapped(name, fn, cost=cost)


class Flat(NamedTuple):
    """How a params pytree is raveled into one flat buffer per dtype, padded to k slices of `chunks[j]`.

    Attributes:
      treedef: the params' tree structure.
      layout: which leaves go into which dtype's buffer (the layout `fused` uses).
      sizes: each buffer's real length N_j (without padding).
      k: the number of slices (devices).
    """

    treedef: Any
    layout: Layout
    sizes: tuple[int, ...]
    k: int

    @property
    def chunks(self) -> tuple[int, ...]:
        """Each buffer's slice length c_j = ⌈N_j / k⌉ (at least 1)."""
        return tuple(max(1, -(-n // self.k)) for n in self.sizes)

    def flatten(self, tree: PyTree) -> list[jax.Array]:
        """The leaves raveled into one buffer per dtype, zero-padded to k·c_j elements."""
        buffers = to_buckets(jax.tree.leaves(tree), self.layout, None, lead=0)
        return [jnp.pad(b, (0, self.k * c - n)) for b, c, n in zip(buffers, self.chunks, self.sizes, strict=True)]

    def unflatten(self, buffers: Sequence[jax.Array]) -> PyTree:
        """The inverse of `flatten`: the padding cut, the leaves in their shapes."""
        cut = [b[:n] for b, n in zip(buffers, self.sizes, strict=True)]
        return jax.tree.unflatten(self.treedef, from_buckets(cut, self.layout, None, lead=0))

    def slices(self, tree: PyTree, index: jax.Array) -> list[jax.Array]:
        """Slice `index` (c_j elements) of each buffer of `tree`."""
        return [lax.dynamic_slice_in_dim(b, index * c, c) for b, c in zip(self.flatten(tree), self.chunks, strict=True)]


def plan(params: PyTree, k: int) -> Flat:
    """The flat layout of `params` (arrays or `jax.ShapeDtypeStruct`s) over k devices."""
    leaves, treedef = jax.tree.flatten(params)
    layout = layout_of(leaves, lead=0)
    return Flat(treedef, layout, tuple(sum(math.prod(s) for _, s in entries) for _, entries in layout), k)
