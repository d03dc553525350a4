"""Allreduce algorithms inside the mapped step, as collectives over the device axis.

Each is called on one device's local tree as `fn(tree, axis_name)`. For a buffer of N bytes on
each of k devices (p the largest power of two ≤ k):

=============  ==============================================  ==================
strategy       what one device sends                           sequential steps
=============  ==============================================  ==================
psum           XLA's choice                                    XLA's choice
ring           2(k−1)/k·N                                      2(k−1)
tree           2(p−1)/p·N (+N to fold k−p extra devices)       2·log2(p) (+2)
hierarchical   2(L−1)/L·N within a host, plus the outer         2(L−1) + the outer
               algorithm's share of N/L across hosts            algorithm's steps
=============  ==============================================  ==================

`ring` and `tree` also run over `groups`: equal groups of device indices, each running the
algorithm on its own, side by side (a ring over a group is a `ppermute` whose pairs stay inside
it). `hierarchical` is built from them: a ring within each host, any of them across hosts.

Every algorithm computes each element of the sum on exactly one device and copies that result to
the others, so all devices hold bit-identical values and the replicas never drift apart. psum and
ring also come as halves (reduce-scatter, all-gather), which the sharded optimizer calls apart.

References:
  Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009.
  Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", 2005.
"""

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp.errors import Arg, ConfigError
from jdp.types import PyTree

Groups = tuple[tuple[int, ...], ...]  # device indices on the axis, cut into equal groups; None: one group of all
SWAP_PIECE_BYTES = 64 * 1024  # the largest piece of a swap between processes (`swap_in_pieces`)


def psum(tree: PyTree, axis_name: str) -> PyTree:
    """XLA's all-reduce collective over `axis_name`; the reference every other strategy must equal."""
    return lax.psum(tree, axis_name)  # one all-reduce per leaf (XLA may combine them)


def psum_scatter(flat: jax.Array, axis_name: str) -> jax.Array:
    """XLA's reduce-scatter: device i gets the sum over devices of slice i."""
    return lax.psum_scatter(flat, axis_name, tiled=True)


def all_gather(mine: jax.Array, axis_name: str) -> jax.Array:
    """XLA's all-gather: every device gets every device's slice, in device order."""
    return lax.all_gather(mine, axis_name, tiled=True)


def ring(tree: PyTree, axis_name: str, wire: jnp.dtype | None = None, groups: Groups | None = None) -> PyTree:
    """Ring allreduce from `lax.ppermute`: reduce-scatter, then all-gather, k−1 steps each.

    Each buffer is cut into k chunks. In reduce-scatter step s, device i passes chunk (i−1−s) mod k
    to its right neighbour, which adds it to its own copy of that chunk; after k−1 steps device i
    holds the full sum of chunk i. All-gather then passes the finished chunks round the ring.
    Every device sends and receives 2(k−1)/k·N bytes, the minimum for any allreduce, and every
    link carries traffic at every step (Patarasuk & Yuan 2009).

    With `wire` (e.g. bfloat16) every chunk is sent in that dtype but added in the buffer's own
    dtype at every hop: low-precision traffic without low-precision sums (`--compress bf16-wire`).
    With `groups`, each group is a ring of its own (k = the group's size, i = the place in it).
    """
    return jax.tree.map(partial(_ring_sum, axis_name=axis_name, wire=wire, groups=groups), tree)


def _ring_sum(x: jax.Array, axis_name: str, wire: jnp.dtype | None = None, groups: Groups | None = None) -> jax.Array:
    k = group_size(axis_name, groups)
    if k == 1 or x.size == 0:
        return x
    mine = ring_reduce_scatter(pad(x.ravel(), k), axis_name, wire, groups)
    if wire is not None:  # the finished chunk rounded as it will be sent: the same bits on every device
        mine = rounded(mine, wire)
    return ring_all_gather(mine, axis_name, wire, groups)[: x.size].reshape(x.shape)


def ring_reduce_scatter(flat: jax.Array, axis_name: str, wire: jnp.dtype | None = None,
                        groups: Groups | None = None) -> jax.Array:
    """The ring's first half: a 1-D buffer of k·c elements in, the sum over devices of chunk i out.

    In step s = 0 … k−2, device i passes chunk (i−1−s) mod k to device i+1, which adds it to its
    own copy; chunk c travels c+1 → c+2 → … → c, collecting every device's term. Each device sends
    (k−1)/k·N bytes.
    """
    k = group_size(axis_name, groups)
    if k == 1:
        return flat
    i = group_index(axis_name, groups)
    chunks = flat.reshape(k, -1)

    def step(s, chunks):
        received = _send(_row(chunks, (i - 1 - s) % k), axis_name, wire, groups)  # chunk i−1−s → device i+1
        target = (i - 2 - s) % k  # what device i−1 sent
        return _set_row(chunks, target, _row(chunks, target) + received)

    return _row(lax.fori_loop(0, k - 1, step, chunks), i)


def ring_all_gather(mine: jax.Array, axis_name: str, wire: jnp.dtype | None = None,
                    groups: Groups | None = None) -> jax.Array:
    """The ring's second half: device i's chunk i in, every chunk, in order, out (k·c elements).

    In step s, device i passes chunk (i−s) mod k on to device i+1, which keeps it; (k−1)/k·N bytes
    sent per device.
    """
    k = group_size(axis_name, groups)
    if k == 1:
        return mine
    i = group_index(axis_name, groups)
    chunks = _set_row(jnp.zeros((k, *mine.shape), mine.dtype), i, mine)

    def step(s, chunks):
        received = _send(_row(chunks, (i - s) % k), axis_name, wire, groups)  # chunk i−s → device i+1
        return _set_row(chunks, (i - 1 - s) % k, received)

    return lax.fori_loop(0, k - 1, step, chunks).ravel()


def rounded(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`x` rounded to `dtype` and back, kept in the program: XLA may drop a convert pair with nothing in
    between (it allows excess precision; under jdp's CPU flags it does), and the chunk a device keeps
    must round as the copies it sends do."""
    return lax.optimization_barrier(x.astype(dtype)).astype(x.dtype)


def _send(row: jax.Array, axis_name: str, wire: jnp.dtype | None, groups: Groups | None) -> jax.Array:
    """One hop to the right neighbour, in the `wire` dtype if any, added in the buffer's own dtype."""
    sent = row if wire is None else row.astype(wire)
    k = group_size(axis_name, groups)
    right = links([(j, (j + 1) % k) for j in range(k)], groups)  # device j sends to j+1 (mod k)
    return _permute(sent, axis_name, right).astype(row.dtype)


def _permute(x: jax.Array, axis_name: str, pairs: list[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute`; a swap between processes in pieces (`swap_in_pieces`)."""
    if swaps_between_processes(pairs, axis_name):
        return swap_in_pieces(x, axis_name, pairs)
    return lax.ppermute(x, axis_name, pairs)


def swaps_between_processes(pairs: Sequence[tuple[int, int]], axis_name: str) -> bool:
    """Whether `ppermute`'s (source, destination) `pairs` are swaps (each device sends to the one it receives
    from) and some cross between processes. jdp's devices are ordered process by process, the same number
    from each (`jdp.select_devices`); another order changes only whether a swap goes in pieces, not its bits."""
    if jax.process_count() == 1 or not set(pairs) == {(b, a) for a, b in pairs}:
        return False
    per_process = lax.axis_size(axis_name) // jax.process_count()
    return any(a // per_process != b // per_process for a, b in pairs)


def swap_in_pieces(x: jax.Array, axis_name: str, pairs: list[tuple[int, int]]) -> jax.Array:
    """`lax.ppermute(x, axis_name, pairs)` in pieces of at most `SWAP_PIECE_BYTES`, one after the other: how
    the ring and the tree swap between processes.

    A ring step with two members, and every step of the tree's halving and doubling, is a swap (each device
    sends to the one it receives from). Gloo's TCP transport, which carries collectives between processes on
    the CPU, runs the two directions of a large swap one after the other, at half the link's full-duplex rate;
    pieces this small overlap them (docs/cluster.md, "Where each falls short, and why"). Within one process a
    swap is a copy, sent whole.
    """
    if x.nbytes <= SWAP_PIECE_BYTES:
        return lax.ppermute(x, axis_name, pairs)
    pieces = jnp.array_split(x, -(-x.nbytes // SWAP_PIECE_BYTES))
    return jnp.concatenate([lax.ppermute(piece, axis_name, pairs) for piece in pieces])


def tree(tree: PyTree, axis_name: str, groups: Groups | None = None) -> PyTree:
    """Recursive-halving reduce-scatter, then recursive-doubling all-gather, from `lax.ppermute`.

    With p = k a power of two: in step d = p/2, p/4, …, 1 device i swaps half of its current
    segment with device i XOR d and adds the half it keeps, so after log2(p) steps device i holds
    the sum of chunk i; the all-gather retraces the steps, doubling the segment each time. That is
    2·log2(p) steps instead of the ring's 2(k−1), for the same 2(p−1)/p·N bytes sent.

    Any k works: the r = k − p devices beyond the largest power of two first send their whole
    buffer to devices 0..r−1 (which add it), sit out the exchange, and receive the result at the
    end (Thakur, Rabenseifner & Gropp 2005). With `groups`, each group is a tree of its own.
    """
    return jax.tree.map(partial(_tree_sum, axis_name=axis_name, groups=groups), tree)


def _tree_sum(x: jax.Array, axis_name: str, groups: Groups | None = None) -> jax.Array:
    k = group_size(axis_name, groups)
    if k == 1 or x.size == 0:
        return x
    p = 1 << (k.bit_length() - 1)  # the largest power of two ≤ k
    extra = k - p
    i = group_index(axis_name, groups)

    def swap(value: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:  # device a sends to b, for (a, b) in pairs
        return _permute(value, axis_name, links(pairs, groups))

    flat = x.ravel()
    if extra:  # fold: device p+j sends its buffer to device j, which adds it
        received = swap(flat, [(p + j, j) for j in range(extra)])
        flat = jnp.where(i < extra, flat + received, flat)
    segment = pad(flat, p)
    d = p // 2
    while d >= 1:  # reduce-scatter by recursive halving: keep one half, send the other to i XOR d
        low, high = jnp.split(segment, 2)
        upper = (i & d) != 0
        received = swap(jnp.where(upper, low, high), [(j, j ^ d) for j in range(p)])
        segment = jnp.where(upper, high, low) + received
        d //= 2
    d = 1
    while d < p:  # all-gather by recursive doubling: swap segments with i XOR d, concatenate in order
        received = swap(segment, [(j, j ^ d) for j in range(p)])
        upper = (i & d) != 0
        segment = jnp.where(upper, jnp.concatenate([received, segment]), jnp.concatenate([segment, received]))
        d *= 2
    flat = segment[: x.size]
    if extra:  # unfold: device j sends the result back to device p+j
        received = swap(flat, [(j, p + j) for j in range(extra)])
        flat = jnp.where(i >= p, received, flat)
    return flat.reshape(x.shape)


def hierarchical(tree: PyTree, axis_name: str, outer: str = "ring", shape: tuple[int, int] | None = None,
                 wire: jnp.dtype | None = None) -> PyTree:
    """Two-level allreduce on hosts × local devices: within each host, across hosts, within again.

    The k = H·L devices are host-major: device d is local device d % L of host d // L. Each buffer
    is cut into L chunks, and
      1. a ring within each host reduce-scatters: local device l holds its host's sum of chunk l
         (L−1 steps, (L−1)/L·N bytes sent, all on the host's own links);
      2. the L devices with local index l, one per host, allreduce chunk l with `outer`: "ring",
         "tree" or "psum" (`lax.psum` over `axis_index_groups`) — N/L bytes per device enter the
         slow links between hosts, L times fewer than a flat ring's;
      3. a ring within each host all-gathers the finished chunks (L−1 steps).
    Each element of the sum is computed on one device and copied, so all k devices hold the same bits.

    Args:
      tree, axis_name: as for every strategy.
      outer: the algorithm across hosts.
      shape: (H, L); None: one host per process, L = this process's devices in the step.
      wire: with outer "ring", the dtype the cross-host chunks travel in (`ring`'s `wire`).

    Raises:
      ConfigError: if the step's devices are not H·L, or (several processes) a host would span two.
    """
    inner, across = host_groups(lax.axis_size(axis_name), shape)
    if outer == "psum":
        between = partial(lax.psum, axis_name=axis_name, axis_index_groups=[list(g) for g in across])
    elif outer == "tree":
        between = partial(_tree_sum, axis_name=axis_name, groups=across)
    else:
        between = partial(_ring_sum, axis_name=axis_name, wire=wire, groups=across)

    def allreduce(x: jax.Array) -> jax.Array:
        local = len(inner[0])
        if x.size == 0:
            return x
        mine = ring_reduce_scatter(pad(x.ravel(), local), axis_name, groups=inner)  # 1. the host's sum of chunk l
        if len(across[0]) > 1:
            mine = between(mine)  # 2. + every other host's chunk l
        return ring_all_gather(mine, axis_name, groups=inner)[: x.size].reshape(x.shape)  # 3. to the host's devices

    return jax.tree.map(allreduce, tree)


def hierarchical_reduce_scatter(flat: jax.Array, axis_name: str, shape: tuple[int, int] | None = None) -> jax.Array:
    """The first half with a ring across hosts: k·c elements in, slice d of the sum out on device d.

    Slices are dealt to local indices first: chunk l of the within-host ring holds slices h·L + l of
    every host h, so the ring across hosts then leaves device h·L + l with exactly its own slice.
    """
    inner, across = host_groups(lax.axis_size(axis_name), shape)
    hosts, local = len(across[0]), len(inner[0])
    by_local = flat.reshape(hosts, local, -1).swapaxes(0, 1).ravel()  # chunk l: slices l, L + l, 2L + l, …
    mine = ring_reduce_scatter(by_local, axis_name, groups=inner)  # this host's sum of chunk l
    return ring_reduce_scatter(mine, axis_name, groups=across)  # + every other host's: slice h·L + l, summed


def hierarchical_all_gather(mine: jax.Array, axis_name: str, shape: tuple[int, int] | None = None) -> jax.Array:
    """The second half: device d's slice d in, all k slices in device order out (across hosts, then within)."""
    inner, across = host_groups(lax.axis_size(axis_name), shape)
    hosts, local = len(across[0]), len(inner[0])
    by_local = ring_all_gather(ring_all_gather(mine, axis_name, groups=across), axis_name, groups=inner)
    return by_local.reshape(local, hosts, -1).swapaxes(0, 1).ravel()


def host_groups(k: int, shape: tuple[int, int] | None = None) -> tuple[Groups, Groups]:
    """(each host's devices, the devices of each local index across hosts) for k host-major devices.

    `shape` (H, L) is the grouping asked for; None: one host per process (`jdp.select_devices`
    orders the step's devices by process, each process giving the same number).

    Raises:
      ConfigError: if H·L ≠ k, or with several processes a host's devices would lie in two of them.
    """
    processes = jax.process_count()
    hosts, local = (processes, k // processes) if shape is None else shape
    if hosts * local != k:
        split = next(h for h in range(2, k + 1) if k % h == 0) if k > 1 else 1  # the smallest host count above 1
        raise ConfigError(
            f"A hierarchical allreduce on {hosts} hosts × {local} local devices needs {hosts * local} devices, but "
            f"the step runs on {k}; give a grouping HxL with H·L = {k}, e.g. ",
            Arg("allreduce", f"hierarchical:{split}x{k // split}"), "."
        )
    if processes > 1 and (k // processes) % local:
        raise ConfigError(
            f"A hierarchical allreduce on {hosts} hosts × {local} local devices puts one host's devices in two of "
            f"the {processes} processes ({k // processes} devices each); use a local count L that divides "
            f"{k // processes}, or ", Arg("allreduce", "hierarchical"), " (one host per process)."
        )
    grid = np.arange(k).reshape(hosts, local)
    return tuple(map(tuple, grid.tolist())), tuple(map(tuple, grid.T.tolist()))


def group_size(axis_name: str, groups: Groups | None) -> int:
    """How many devices run the algorithm together: the group's, or the whole axis."""
    return lax.axis_size(axis_name) if groups is None else len(groups[0])


def group_index(axis_name: str, groups: Groups | None) -> jax.Array:
    """This device's place in its group (its index on the axis if there are no groups)."""
    i = lax.axis_index(axis_name)
    if groups is None:
        return i
    place = np.zeros(sum(map(len, groups)), np.int32)
    for group in groups:
        place[list(group)] = np.arange(len(group))
    return jnp.asarray(place)[i]


def links(pairs: Sequence[tuple[int, int]], groups: Groups | None) -> list[tuple[int, int]]:
    """`ppermute`'s (source, destination) devices for places (a, b) in a group: in every group if any."""
    if groups is None:
        return list(pairs)
    return [(group[a], group[b]) for group in groups for a, b in pairs]


def pad(flat: jax.Array, multiple: int) -> jax.Array:
    """Zero-pads a 1-D array to a length divisible by `multiple` (zeros add nothing to a sum)."""
    return jnp.pad(flat, (0, -flat.size % multiple))


def _row(chunks: jax.Array, index: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(chunks, index, keepdims=False)


def _set_row(chunks: jax.Array, index: jax.Array, row: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(chunks, row, index, 0)
