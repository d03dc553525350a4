"""Allreduce algorithms outside the mapped step, from explicit copies between devices.

Each is called between two mapped functions as `fn(tree)`, on global arrays of shape (k, ...)
with slice i on device i, and moves buffers with `jax.device_put`, as the lesson's allreduce
does: the gradients leave the device computation, are copied, summed, copied back. For a buffer
of N bytes on each of k devices:

=============  ==============================================  ==================
strategy       what one device sends                           sequential steps
=============  ==============================================  ==================
manual (star)  N (the root: (k−1)·N in and (k−1)·N out)        2(k−1) copies
manual_ring    2(k−1)/k·N                                      2(k−1)
=============  ==============================================  ==================

Both also come as halves (reduce-scatter, all-gather) on (k, k·c) and (k, c) arrays, which the
sharded optimizer calls apart. Every element of the sum is computed on one device and copied to
the others, so all devices hold bit-identical values.

Reference:
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009.
"""

import math
from collections.abc import Callable
from functools import lru_cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdp.parallel.collectives import pad
from jdp.parallel.layout import map_over_devices, sharded
from jdp.types import PyTree


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
    return jax.make_array_from_single_device_arrays(shape, sharded([r.device for r in rows]), rows)


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
    k = len(devices)

    def stack(rows: list[jax.Array]) -> jax.Array:
        return _from_rows(rows, (k, *rows[0].shape[1:]))

    def split(x):  # this device's slice → k zero-padded chunks
        return tuple(pad(x.ravel(), k).reshape(k, -1))

    def unsplit(shape, *pieces):  # the inverse of split, the padding cut
        return (jnp.concatenate(pieces)[: math.prod(shape)].reshape(shape),)

    @partial(jax.jit, static_argnums=1)
    def join(pieces, shape):
        return map_over_devices(partial(unsplit, shape), devices, "shard_map", ("per_device",) * k,
                                ("per_device",))(*pieces)[0]

    return _RingPrograms(stack, map_over_devices(split, devices, "shard_map", ("per_device",), ("per_device",) * k),
                         join)


def _ordered_shards(x: jax.Array) -> list[jax.Shard]:
    """The shards of a (k, ...) array in device-axis order: slice i first on device i."""
    return sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
