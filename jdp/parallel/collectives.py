"""Allreduce algorithms inside the mapped step, as collectives over the device axis.

Each is called on one device's local tree as `fn(tree, axis_name)`. For a buffer of N bytes on
each of k devices (p the largest power of two ≤ k):

=============  ==============================================  ==================
strategy       what one device sends                           sequential steps
=============  ==============================================  ==================
psum           XLA's choice                                    XLA's choice
ring           2(k−1)/k·N                                      2(k−1)
tree           2(p−1)/p·N (+N to fold k−p extra devices)       2·log2(p) (+2)
=============  ==============================================  ==================

Every algorithm computes each element of the sum on exactly one device and copies that result to
the others, so all devices hold bit-identical values and the replicas never drift apart. psum and
ring also come as halves (reduce-scatter, all-gather), which the sharded optimizer calls apart.

References:
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009.
  Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", 2005.
"""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any


def psum(tree: PyTree, axis_name: str) -> PyTree:
    """XLA's all-reduce collective over `axis_name`; the reference every other strategy must equal."""
    return lax.psum(tree, axis_name)  # one all-reduce per leaf (XLA may combine them)


def psum_scatter(flat: jax.Array, axis_name: str) -> jax.Array:
    """XLA's reduce-scatter: device i gets the sum over devices of slice i."""
    return lax.psum_scatter(flat, axis_name, tiled=True)


def all_gather(mine: jax.Array, axis_name: str) -> jax.Array:
    """XLA's all-gather: every device gets every device's slice, in device order."""
    return lax.all_gather(mine, axis_name, tiled=True)


def ring(tree: PyTree, axis_name: str, wire: jnp.dtype | None = None) -> PyTree:
    """Ring allreduce from `lax.ppermute`: reduce-scatter, then all-gather, k−1 steps each.

    Each buffer is cut into k chunks. In reduce-scatter step s, device i passes chunk (i−1−s) mod k
    to its right neighbour, which adds it to its own copy of that chunk; after k−1 steps device i
    holds the full sum of chunk i. All-gather then passes the finished chunks round the ring.
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
    mine = ring_reduce_scatter(pad(x.ravel(), k), axis_name, wire)
    if wire is not None:  # the finished chunk rounded as it will be sent: the same bits on every device
        mine = mine.astype(wire).astype(x.dtype)
    return ring_all_gather(mine, axis_name, wire)[: x.size].reshape(x.shape)


def ring_reduce_scatter(flat: jax.Array, axis_name: str, wire: jnp.dtype | None = None) -> jax.Array:
    """The ring's first half: a 1-D buffer of k·c elements in, the sum over devices of chunk i out.

    In step s = 0 … k−2, device i passes chunk (i−1−s) mod k to device i+1, which adds it to its
    own copy; chunk c travels c+1 → c+2 → … → c, collecting every device's term. Each device sends
    (k−1)/k·N bytes.
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

    In step s, device i passes chunk (i−s) mod k on to device i+1, which keeps it; (k−1)/k·N bytes
    sent per device.
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
    segment = pad(flat, p)
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


def pad(flat: jax.Array, multiple: int) -> jax.Array:
    """Zero-pads a 1-D array to a length divisible by `multiple` (zeros add nothing to a sum)."""
    return jnp.pad(flat, (0, -flat.size % multiple))


def _row(chunks: jax.Array, index: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(chunks, index, keepdims=False)


def _set_row(chunks: jax.Array, index: jax.Array, row: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(chunks, row, index, 0)
