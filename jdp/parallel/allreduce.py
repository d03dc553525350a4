"""Allreduce strategies: a gradient pytree in, its sum over devices on every device out.

Two places an allreduce can run, and so two kinds of strategy:

* ``inside`` the mapped step, as collectives over the device axis: ``fn(tree, axis_name)``,
  called on each device's local tree (no leading device axis).
* ``outside`` it, between two mapped functions, moving buffers with explicit ``jax.device_put``:
  ``fn(tree)``, where every leaf is a global array of shape (k, ...) with slice i on device i.
  This is how the lesson's allreduce works: gradients leave the device computation, are copied,
  summed, copied back.

The algorithms, for a buffer of N bytes on each of k devices:

=============  ========  ==============================================  ==================
strategy       where     what one device sends                           sequential steps
=============  ========  ==============================================  ==================
psum           inside    XLA's choice                                    XLA's choice
manual (star)  outside   N (the root: (k−1)·N in and (k−1)·N out)        2(k−1) copies
manual_ring    outside   2(k−1)/k·N                                      2(k−1)
ring           inside    2(k−1)/k·N                                      2(k−1)
tree           inside    2(p−1)/p·N (+N to fold k−p extra devices)       2·log2(p) (+2)
=============  ========  ==============================================  ==================

(p is the largest power of two ≤ k.) Every strategy computes each element of the sum on exactly
one device and copies that result to the others, so all devices hold bit-identical values and the
replicas never drift apart. `fused` wraps any of them to allreduce a few large buffers instead of
one small buffer per leaf.

References:
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009.
  Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", 2005.
"""

import math
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.errors import ConfigError

PyTree = Any


class Allreduce(NamedTuple):
    """A named allreduce algorithm: what `jdp.make_train_step` calls to sum the gradients.

    Attributes:
      name: what the CLI calls it (with `+fused` / `+bucketsM` when wrapped by `fused`).
      fn: the algorithm. "inside": `fn(tree, axis_name) -> tree`, traced in the mapped step on each
        device's local tree, built from collectives over `axis_name`. "outside": `fn(tree) -> tree`,
        called between mapped functions on global arrays of shape (k, ...) with slice i on device i,
        moving buffers with `jax.device_put`.
      where: "inside" or "outside".
      init: None for a stateless strategy. A stateful one (PowerSGD's error feedback, see
        `jdp.parallel.compress`) keeps state on each device between steps: `init(key, grads)` builds one
        device's initial state from a gradient-shaped tree, and `fn` takes and returns it:
        `fn(tree, state, axis_name) -> (tree, state)` inside, `fn(tree, state) -> (tree, state)`
        outside, there with every state leaf of shape (k, ...), slice i on device i.
    """

    name: str
    fn: Callable[..., PyTree]
    where: Literal["inside", "outside"] = "inside"
    init: Callable[[jax.Array, PyTree], PyTree] | None = None


# --- inside the mapped step: collectives over the device axis -------------------------------


def psum(tree: PyTree, axis_name: str) -> PyTree:
    """XLA's all-reduce collective over `axis_name`; the reference every other strategy must equal."""
    return lax.psum(tree, axis_name)  # one all-reduce per leaf (XLA may combine them)


def ring(tree: PyTree, axis_name: str, wire: jnp.dtype | None = None) -> PyTree:
    """Ring allreduce from `lax.ppermute`: reduce-scatter, then all-gather, k−1 steps each.

    Each buffer is cut into k chunks. In reduce-scatter step s, device i passes chunk (i−1−s) mod k
    to its right neighbour, which adds it to its own copy of that chunk; after k−1 steps device i
    holds the full sum of chunk i. All-gather then passes the finished chunks round the ring. The
    two halves are `ring_reduce_scatter` and `ring_all_gather`, which the sharded optimizer
    (`jdp.parallel.zero`) uses on their own.
    Every device sends and receives 2(k−1)/k·N bytes, the minimum for any allreduce, and every
    link carries traffic at every step (Patarasuk & Yuan 2009).

    With `wire` (e.g. bfloat16) every chunk is sent in that dtype but added in the buffer's own
    dtype at every hop: low-precision traffic without low-precision sums (`--compress bf16-wire`).
    """
    return jax.tree.map(partial(_ring_sum, axis_name=axis_name, wire=wire), tree)


def _ring_sum(x: jax.Array, axis_name: str, wire: jnp.dtype | None = None) -> jax.Array:
    k = lax.axis_size(axis_name)
    if k == 1 or x.size == 0:
        return x
    mine = ring_reduce_scatter(_pad(x.ravel(), k), axis_name, wire)
    if wire is not None:  # the finished chunk rounded as it will be sent: the same bits on every device
        mine = mine.astype(wire).astype(x.dtype)
    return ring_all_gather(mine, axis_name, wire)[: x.size].reshape(x.shape)


def ring_reduce_scatter(flat: jax.Array, axis_name: str, wire: jnp.dtype | None = None) -> jax.Array:
    """The ring's first half: a 1-D buffer of k·c elements in, the sum over devices of chunk i out.

    The same contract as `lax.psum_scatter(flat, axis_name, tiled=True)`: device i ends with the
    c elements [i·c, (i+1)·c) of the sum. In step s = 0 … k−2, device i passes chunk (i−1−s) mod k
    to device i+1, which adds it to its own copy; chunk c travels c+1 → c+2 → … → c, collecting
    every device's term. Each device sends (k−1)/k·N bytes.
    """
    k = lax.axis_size(axis_name)
    if k == 1:
        return flat
    i = lax.axis_index(axis_name)
    chunks = flat.reshape(k, -1)

    def step(s, chunks):
        received = _send(_row(chunks, (i - 1 - s) % k), axis_name, wire)  # chunk i−1−s → device i+1
        target = (i - 2 - s) % k  # what device i−1 sent
        return _set_row(chunks, target, _row(chunks, target) + received)

    return _row(lax.fori_loop(0, k - 1, step, chunks), i)


def ring_all_gather(mine: jax.Array, axis_name: str, wire: jnp.dtype | None = None) -> jax.Array:
    """The ring's second half: device i's chunk i in, every chunk, in order, out (k·c elements).

    The same contract as `lax.all_gather(mine, axis_name, tiled=True)`. In step s, device i passes
    chunk (i−s) mod k on to device i+1, which keeps it; (k−1)/k·N bytes sent per device.
    """
    k = lax.axis_size(axis_name)
    if k == 1:
        return mine
    i = lax.axis_index(axis_name)
    chunks = _set_row(jnp.zeros((k, *mine.shape), mine.dtype), i, mine)

    def step(s, chunks):
        received = _send(_row(chunks, (i - s) % k), axis_name, wire)  # chunk i−s → device i+1
        return _set_row(chunks, (i - 1 - s) % k, received)

    return lax.fori_loop(0, k - 1, step, chunks).ravel()


def _send(row: jax.Array, axis_name: str, wire: jnp.dtype | None) -> jax.Array:
    """One hop to the right neighbour, in the `wire` dtype if any, added in the buffer's own dtype."""
    sent = row if wire is None else row.astype(wire)
    return lax.ppermute(sent, axis_name, _right(lax.axis_size(axis_name))).astype(row.dtype)


def _right(k: int) -> list[tuple[int, int]]:
    """The ring's links: device j sends to device j+1 (mod k)."""
    return [(j, (j + 1) % k) for j in range(k)]


def tree(tree: PyTree, axis_name: str) -> PyTree:
    """Recursive-halving reduce-scatter, then recursive-doubling all-gather, from `lax.ppermute`.

    With p = k a power of two: in step d = p/2, p/4, …, 1 device i swaps half of its current
    segment with device i XOR d and adds the half it keeps, so after log2(p) steps device i holds
    the sum of chunk i; the all-gather retraces the steps, doubling the segment each time. That is
    2·log2(p) steps instead of the ring's 2(k−1), for the same 2(p−1)/p·N bytes sent.

    Any k works: the r = k − p devices beyond the largest power of two first send their whole
    buffer to devices 0..r−1 (which add it), sit out the exchange, and receive the result at the
    end (Thakur, Rabenseifner & Gropp 2005).
    """
    return jax.tree.map(partial(_tree_sum, axis_name=axis_name), tree)


def _tree_sum(x: jax.Array, axis_name: str) -> jax.Array:
    k = lax.axis_size(axis_name)
    if k == 1 or x.size == 0:
        return x
    p = 1 << (k.bit_length() - 1)  # the largest power of two ≤ k
    extra = k - p
    i = lax.axis_index(axis_name)
    flat = x.ravel()
    if extra:  # fold: device p+j sends its buffer to device j, which adds it
        received = lax.ppermute(flat, axis_name, [(p + j, j) for j in range(extra)])
        flat = jnp.where(i < extra, flat + received, flat)
    segment = _pad(flat, p)
    d = p // 2
    while d >= 1:  # reduce-scatter by recursive halving: keep one half, send the other to i XOR d
        low, high = jnp.split(segment, 2)
        upper = (i & d) != 0
        received = lax.ppermute(jnp.where(upper, low, high), axis_name, [(j, j ^ d) for j in range(p)])
        segment = jnp.where(upper, high, low) + received
        d //= 2
    d = 1
    while d < p:  # all-gather by recursive doubling: swap segments with i XOR d, concatenate in order
        received = lax.ppermute(segment, axis_name, [(j, j ^ d) for j in range(p)])
        upper = (i & d) != 0
        segment = jnp.where(upper, jnp.concatenate([received, segment]), jnp.concatenate([segment, received]))
        d *= 2
    flat = segment[: x.size]
    if extra:  # unfold: device j sends the result back to device p+j
        received = lax.ppermute(flat, axis_name, [(j, p + j) for j in range(extra)])
        flat = jnp.where(i >= p, received, flat)
    return flat.reshape(x.shape)


def _pad(flat: jax.Array, multiple: int) -> jax.Array:
    """Zero-pads a 1-D array to a length divisible by `multiple` (zeros add nothing to a sum)."""
    return jnp.pad(flat, (0, -flat.size % multiple))


def _row(chunks: jax.Array, index: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(chunks, index, keepdims=False)


def _set_row(chunks: jax.Array, index: jax.Array, row: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(chunks, row, index, 0)


# --- outside the mapped step: explicit copies between devices --------------------------------


def manual(tree: PyTree) -> PyTree:
    """The lesson's star allreduce: copy every device's buffer to device 0, add there, copy back.

    Device 0 receives (k−1)·N and sends (k−1)·N bytes for a buffer of N bytes: the root is the
    bottleneck, which is why ring allreduce (Patarasuk & Yuan 2009) scales better.
    """
    return jax.tree.map(_star_sum, tree)


def _star_sum(x: jax.Array) -> jax.Array:
    shards = _ordered_shards(x)
    total = _sum_at_root(shards)
    copies = [jax.device_put(total, s.device) for s in shards]  # copy the sum back to every device
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)


def _sum_at_root(shards: list[jax.Shard]) -> jax.Array:
    """Copies every device's buffer to device 0 and adds them there, in device order."""
    root = shards[0].device
    total = shards[0].data
    for shard in shards[1:]:
        total = total + jax.device_put(shard.data, root)  # copy device i → device 0, add on device 0
    return total


def manual_reduce_scatter(x: jax.Array) -> jax.Array:
    """The star's reduce-scatter: the sum formed on device 0 as in `manual`, then chunk i copied to device i.

    Args:
      x: (k, k·c), row i on device i.

    Returns:
      (k, c), row i on device i: the sum over devices of the elements [i·c, (i+1)·c).
    """
    shards = _ordered_shards(x)
    k = len(shards)
    total = _sum_at_root(shards).reshape(k, 1, -1)
    return _from_rows([jax.device_put(total[i], s.device) for i, s in enumerate(shards)],  # chunk i → device i
                      (k, x.shape[1] // k))


def manual_all_gather(x: jax.Array) -> jax.Array:
    """The star's all-gather: every chunk copied to device 0, joined there, the whole copied back.

    Args:
      x: (k, c), row i on device i.

    Returns:
      (k, k·c): every row the k chunks in order, row i on device i.
    """
    shards = _ordered_shards(x)
    root = shards[0].device
    whole = jnp.concatenate([jax.device_put(s.data, root) for s in shards], axis=1)  # chunk i → device 0
    copies = [jax.device_put(whole, s.device) for s in shards]  # the whole buffer → every device
    return _from_rows(copies, (len(shards), whole.shape[1]))


def manual_ring(tree: PyTree) -> PyTree:
    """Ring allreduce from explicit `jax.device_put` copies between neighbours.

    The same schedule as `ring`, written the lesson's way: each device's buffer is cut into k
    chunks; k−1 reduce-scatter steps copy one chunk from device i to device i+1, which adds it;
    k−1 all-gather steps copy the finished chunks on. Every device sends 2(k−1)/k·N bytes, so no
    device is a bottleneck. Each step is k copies dispatched from the host, plus (in reduce-scatter)
    one addition that runs on every device at once. The halves are `manual_ring_reduce_scatter`
    and `manual_ring_all_gather`.
    """
    return jax.tree.map(_ring_sum_explicit, tree)


def _ring_sum_explicit(x: jax.Array) -> jax.Array:
    def reduce_scatter_then_all_gather(shards, local):
        mine = _scatter_explicit(_chunks_explicit(shards, local), local)  # the sum of chunk i on device i
        rows = _joined_explicit(_gather_explicit(mine), local, x.shape[1:])
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, rows)

    return x if x.size == 0 else _explicit_ring(x, reduce_scatter_then_all_gather)


def manual_ring_reduce_scatter(x: jax.Array) -> jax.Array:
    """`ring_reduce_scatter` from explicit copies: (k, k·c) in, row i the sum of chunk i, (k, c) out."""
    return _explicit_ring(x, lambda shards, local: _from_rows(
        _scatter_explicit(_chunks_explicit(shards, local), local), (len(shards), x.shape[1] // len(shards))))


def manual_ring_all_gather(x: jax.Array) -> jax.Array:
    """`ring_all_gather` from explicit copies: (k, c) in, every row all k chunks in order, (k, k·c) out."""
    size = len(x.addressable_shards) * x.shape[1]
    return _explicit_ring(x, lambda shards, local: _from_rows(
        _joined_explicit(_gather_explicit([s.data for s in shards]), local, (size,)), (len(shards), size)))


def _explicit_ring(x: jax.Array, run: Callable[[list[jax.Shard], "_RingPrograms"], jax.Array]) -> jax.Array:
    """`run(shards, programs)` over the device-ordered shards of a (k, ...) array; `x` itself on one device."""
    shards = _ordered_shards(x)
    if len(shards) == 1:
        return x
    return run(shards, _ring_programs(tuple(s.device for s in shards)))


def _chunks_explicit(shards: list[jax.Shard], local: "_RingPrograms") -> list[list[jax.Array]]:
    """chunks[i][c]: chunk c of device i's buffer, on device i, shape (1, chunk); one dispatch."""
    pieces = local.split(local.stack([s.data for s in shards]))  # pieces[c]: row i = chunk c of device i
    return [[_ordered_shards(piece)[i].data for piece in pieces] for i in range(len(shards))]


def _joined_explicit(chunks: list[dict[int, jax.Array]], local: "_RingPrograms", shape: tuple[int, ...]
                     ) -> list[jax.Array]:
    """Row i: device i's chunks joined in order (the padding cut) and shaped (1, *shape); one dispatch."""
    k = len(chunks)
    out = local.join(tuple(local.stack([chunks[i][c] for i in range(k)]) for c in range(k)), shape)
    return [s.data for s in _ordered_shards(out)]


def _from_rows(rows: list[jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """One (k, ...) array of `rows[i]` (each (1, ...), on device i), sharded over its first axis."""
    sharding = NamedSharding(Mesh(np.asarray([r.device for r in rows]), ("rows",)), P("rows"))
    return jax.make_array_from_single_device_arrays(shape, sharding, rows)


def _scatter_explicit(chunks: list[list[jax.Array]], local: "_RingPrograms") -> list[jax.Array]:
    """Reduce-scatter over `chunks[i][c]` (chunk c on device i): returns the sum of chunk i on device i."""
    k = len(chunks)
    for s in range(k - 1):  # device i sends chunk i−1−s; device i+1 adds it to its own copy
        received = _pass_right([chunks[i][(i - 1 - s) % k] for i in range(k)])
        targets = [(j, (j - 2 - s) % k) for j in range(k)]
        summed = local.stack([chunks[j][c] for j, c in targets]) + local.stack(received)  # every device at once
        for (j, c), part in zip(targets, _ordered_shards(summed), strict=True):
            chunks[j][c] = part.data
    return [chunks[i][i] for i in range(k)]


def _gather_explicit(mine: list[jax.Array]) -> list[dict[int, jax.Array]]:
    """All-gather of `mine[i]` (chunk i on device i): returns chunks[j][c], every chunk on every device j."""
    k = len(mine)
    chunks = [{i: mine[i]} for i in range(k)]
    for s in range(k - 1):  # device i sends its chunk i−s on; device i+1 keeps it
        received = _pass_right([chunks[i][(i - s) % k] for i in range(k)])
        for j in range(k):
            chunks[j][(j - 1 - s) % k] = received[j]
    return chunks


def _pass_right(sent: list[jax.Array]) -> list[jax.Array]:
    """Copies `sent[i]` from device i to device i+1 (mod k): each link of the ring once."""
    destinations = [sent[(i + 1) % len(sent)].device for i in range(len(sent))]
    moved = jax.device_put(sent, destinations)
    return moved[-1:] + moved[:-1]  # received[j] came from device j−1


class _RingPrograms(NamedTuple):
    """`manual_ring`'s per-device reshaping, each one dispatch over all devices (no communication)."""

    stack: Callable[[list[jax.Array]], jax.Array]  # row i from device i → one (k, ...) array, no copy
    split: Callable[[jax.Array], tuple[jax.Array, ...]]  # (k, ...) → k (k, chunk) arrays, zero-padded
    join: Callable[[tuple[jax.Array, ...], tuple[int, ...]], jax.Array]  # the inverse of split


@lru_cache
def _ring_programs(devices: tuple[jax.Device, ...]) -> _RingPrograms:
    k, axis = len(devices), "ring"
    mesh = Mesh(np.asarray(devices), (axis,))
    sharding = NamedSharding(mesh, P(axis))

    def stack(rows: list[jax.Array]) -> jax.Array:
        return jax.make_array_from_single_device_arrays((k, *rows[0].shape[1:]), sharding, rows)

    def split(x):  # this device's (1, ...) slice → k chunks of shape (1, chunk)
        return tuple(_pad(x.ravel(), k).reshape(k, 1, -1))

    @partial(jax.jit, static_argnums=1)
    def join(pieces, shape):
        def unsplit(*pieces):
            return jnp.concatenate(pieces, axis=1)[:, : math.prod(shape)].reshape(1, *shape)

        return jax.shard_map(unsplit, mesh=mesh, in_specs=P(axis), out_specs=P(axis))(*pieces)

    return _RingPrograms(stack, jax.jit(jax.shard_map(split, mesh=mesh, in_specs=P(axis), out_specs=P(axis))), join)


def _ordered_shards(x: jax.Array) -> list[jax.Shard]:
    """The shards of a (k, ...) array in device-axis order: slice i first on device i."""
    return sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)


# --- fusion: few large buffers instead of one small buffer per leaf --------------------------


def fused(strategy: Allreduce, bucket_mb: float | None = None) -> Allreduce:
    """Wraps `strategy` to allreduce the leaves raveled into one buffer per dtype, or buckets.

    Many small allreduces pay a fixed cost (a collective's latency, or a host dispatch per copy)
    for every leaf; one large buffer pays it once. Buckets of at most `bucket_mb` MB (2^20 bytes,
    like PyTorch DDP's `bucket_cap_mb` and Horovod's tensor fusion threshold) bound the extra
    memory. Leaves are grouped by dtype, so nothing is cast and the sums stay those of `strategy`.

    Args:
      strategy: any allreduce strategy.
      bucket_mb: largest bucket in MB; None puts each dtype's leaves in one buffer.

    Returns:
      The fused strategy, named `<name>+fused` or `<name>+buckets<M>MB`.

    Raises:
      ConfigError: if `bucket_mb` is not positive.
    """
    if bucket_mb is not None and not bucket_mb > 0:
        raise ConfigError(f"`--bucket-mb` must be positive, got {bucket_mb}.")
    cap_bytes = None if bucket_mb is None else bucket_mb * 2**20
    name = f"{strategy.name}+fused" if bucket_mb is None else f"{strategy.name}+buckets{bucket_mb:g}MB"

    if strategy.where == "inside":

        def fn_inside(tree: PyTree, axis_name: str) -> PyTree:
            leaves, treedef = jax.tree.flatten(tree)
            layout = _layout(leaves, lead=0)
            buckets = _to_buckets(leaves, layout, cap_bytes, lead=0)
            reduced = strategy.fn(buckets, axis_name)
            return jax.tree.unflatten(treedef, _from_buckets(reduced, layout, cap_bytes, lead=0))

        return Allreduce(name, fn_inside, "inside")

    def fn_outside(tree: PyTree) -> PyTree:
        leaves, treedef = jax.tree.flatten(tree)
        layout = _layout(leaves, lead=1)
        buckets = _to_buckets_jit(leaves, layout, cap_bytes, 1)  # one dispatch; slices stay on their devices
        reduced = strategy.fn(buckets)
        return jax.tree.unflatten(treedef, _from_buckets_jit(reduced, layout, cap_bytes, 1))

    return Allreduce(name, fn_outside, "outside")


# For each dtype in order of first appearance: (dtype, ((leaf index, shape after the lead axes), ...)).
Layout = tuple[tuple[np.dtype, tuple[tuple[int, tuple[int, ...]], ...]], ...]


def _layout(leaves: Sequence[jax.Array], lead: int) -> Layout:
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


def _to_buckets(leaves: Sequence[jax.Array], layout: Layout, cap_bytes: float | None, lead: int) -> list[jax.Array]:
    """Ravels the leaves (keeping the first `lead` axes) into each dtype's buffer, cut into buckets."""
    buckets = []
    for dtype, entries in layout:
        head = leaves[entries[0][0]].shape[:lead]
        buffer = jnp.concatenate([leaves[i].reshape(*head, -1) for i, _ in entries], axis=lead)
        for start, stop in _bounds(buffer.shape[lead], dtype.itemsize, cap_bytes):
            buckets.append(lax.slice_in_dim(buffer, start, stop, axis=lead))
    return buckets


def _from_buckets(buckets: Sequence[jax.Array], layout: Layout, cap_bytes: float | None, lead: int) -> list[jax.Array]:
    """The inverse of `_to_buckets`: the leaves in their original order and shapes."""
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


_to_buckets_jit = jax.jit(_to_buckets, static_argnums=(1, 2, 3))
_from_buckets_jit = jax.jit(_from_buckets, static_argnums=(1, 2, 3))


_STRATEGIES: dict[str, Allreduce] = {  # the registry: built-ins first, then what users register
    "psum": Allreduce("psum", psum),
    "manual": Allreduce("manual", manual, "outside"),
    "manual_ring": Allreduce("manual_ring", manual_ring, "outside"),
    "ring": Allreduce("ring", ring),
    "tree": Allreduce("tree", tree),
}


def register(strategy: Allreduce, *, replace: bool = False) -> Allreduce:
    """Makes `strategy` available by name to `get`, `jdp train --allreduce` and the benches.

    Check it first with `jdp.testing.check_allreduce(strategy)`.

    Raises:
      ConfigError: if it is not an `Allreduce`, its `where` is unknown, or its name is taken (unless `replace`).
    """
    if not isinstance(strategy, Allreduce):
        raise ConfigError(f"`register_allreduce` takes a `jdp.Allreduce`, got {type(strategy).__name__}.")
    if strategy.where not in ("inside", "outside"):
        raise ConfigError(f"Allreduce `{strategy.name}` has `where={strategy.where!r}`; use \"inside\" or \"outside\".")
    if strategy.name in _STRATEGIES and not replace:
        raise ConfigError(f"An allreduce strategy named `{strategy.name}` is registered already; pass `replace=True`.")
    _STRATEGIES[strategy.name] = strategy
    return strategy


def names(where: str | None = None) -> tuple[str, ...]:
    """The registered strategies' names (those of one `where` if given), built-ins first."""
    return tuple(name for name, s in _STRATEGIES.items() if where in (None, s.where))


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
        strategy = name
    elif name in _STRATEGIES:
        strategy = _STRATEGIES[name]
    else:
        raise ConfigError(
            f"Unknown allreduce strategy `{name}`; choose one of: {', '.join(_STRATEGIES)} "
            "(or register your own with `jdp.register_allreduce`, loaded with `--plugin MODULE`)."
        )
    if not fuse:
        if bucket_mb is not None:
            raise ConfigError(f"`--bucket-mb {bucket_mb:g}` only applies to fused buffers; add `--fuse`.")
        return strategy
    return fused(strategy, bucket_mb)
