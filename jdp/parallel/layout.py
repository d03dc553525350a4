"""Placement: where arrays live, and per-device functions mapped over the devices.

The one module that knows the two backends. Every value a mapped function takes or returns is of
one of three kinds:

* ``replicated``: the same value on every device (params; `replicate`, the contract of the removed
  `jax.device_put_replicated`);
* ``per_device``: a different value on each device, (k, ...) with row i on device i (a sharded
  optimizer state, PowerSGD's error feedback, per-device losses and gradients);
* ``batch``: the rows of a global batch, device i holding rows [i·B/k, (i+1)·B/k) (`split_batch`).

The backends lay them out differently, and `map_over_devices` hides the difference:

* ``pmap``: all three carry a leading device axis of size k: params (k, ...), batch (k, B/k, ...).
  This is the layout `jax.pmap` consumes and produces, so arrays flow between steps without copies.
* ``shard_map``: `jax.jit(jax.shard_map(...))` over a 1-D mesh: replicated `P()` in its natural
  shape, per_device (k, ...) `P('data')`, batch (B, ...) `P('data')`.

Every function returns global `jax.Array`s over the 1-D mesh of `mesh`: shard
i lives on device i. Devices are ordered by (process, id), so process p owns a contiguous block of
the mesh and therefore a contiguous block of rows of every global batch (`process_rows`): with
several processes each passes its own rows, and every process the same replicated values.
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.errors import Arg, ConfigError, DeviceError
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

Backend = Literal["pmap", "shard_map"]
BACKENDS: tuple[Backend, ...] = ("pmap", "shard_map")
Kind = Literal["replicated", "per_device", "batch"]
Kinds = Any  # a Kind, or a pytree of Kinds that is a prefix of the value's pytree
_SPECS = {"replicated": P(), "per_device": P(AXIS), "batch": P(AXIS)}


def mesh(devices: Sequence[jax.Device]) -> Mesh:
    """The 1-D device mesh whose axis is `AXIS`, in the order given."""
    return Mesh(np.asarray(devices), (AXIS,))


def check_backend(backend: str) -> None:
    """Raises ConfigError unless `backend` is one of BACKENDS."""
    if backend not in BACKENDS:
        raise ConfigError("Unknown ", Arg("backend", backend), f"; choose one of: {', '.join(BACKENDS)}.")


def map_over_devices(fn: Callable[..., tuple], devices: Sequence[jax.Device], backend: Backend,
                     ins: Sequence[Kinds], outs: Sequence[Kinds], donate: tuple[int, ...] = ()) -> Callable:
    """`fn` of one device's values, mapped over `devices` by `backend`.

    `fn` sees every value without a device axis (a per_device row, a replicated copy, its rows of a
    batch) and may use collectives over `AXIS`; it returns a tuple of `len(outs)` values. The
    mapped function takes and returns global arrays in the layout of `backend` for each kind.
    Under `shard_map` nothing is checked for equality across devices (`check_vma=False`), exactly
    as under `jax.pmap`: see docs/backends.md for why autodiff would otherwise sum the gradients.

    Args:
      fn: the per-device function.
      devices: the mesh, in order.
      backend: "pmap" or "shard_map".
      ins, outs: the kind of each argument and result (a kind, or a pytree prefix of kinds).
      donate: positions of arguments whose buffers the result may reuse.
    """
    check_backend(backend)
    if backend == "pmap":
        return jax.pmap(fn, axis_name=AXIS, devices=devices, donate_argnums=donate)

    def local(*args):
        args = [on_per_device(lambda x: x[0], kinds, a) for a, kinds in zip(args, ins, strict=True)]
        return tuple(on_per_device(lambda x: x[None], kinds, r) for r, kinds in zip(fn(*args), outs, strict=True))

    specs = lambda all_kinds: tuple(jax.tree.map(_SPECS.__getitem__, kinds) for kinds in all_kinds)  # noqa: E731
    return jax.jit(jax.shard_map(local, mesh=mesh(devices), in_specs=specs(ins), out_specs=specs(outs),
                                 check_vma=False), donate_argnums=donate)


def on_per_device(f: Callable[[Any], Any], kinds: Kinds, tree: PyTree) -> PyTree:
    """`f` applied to every leaf of the per_device parts of `tree`, the other parts as they are."""
    return jax.tree.map(lambda kind, part: jax.tree.map(f, part) if kind == "per_device" else part, kinds, tree)


def place(tree: PyTree, kinds: Kinds, devices: Sequence[jax.Device], backend: Backend = "pmap") -> PyTree:
    """Host values → global arrays on `devices`, in the layout of `backend` for each part's kind.

    replicated parts are one value (`replicate`); per_device parts have leaves (k, ...), row i for
    device i; batch parts are this process's rows (`shard_rows`). Every process passes the same
    replicated and per_device values; each places only its own devices' parts.
    """
    check_backend(backend)

    def put(kind: Kind, part: PyTree) -> PyTree:
        if kind == "replicated":
            return replicate(part, devices, backend)
        if kind == "batch":
            return jax.tree.map(lambda rows: shard_rows(rows, devices, backend), part)
        return jax.tree.map(lambda x: jax.make_array_from_callback(
            np.shape(x), sharded(devices), lambda index: np.asarray(x)[index]), part)

    return jax.tree.map(put, kinds, tree)


def fetch(tree: PyTree, kinds: Kinds, backend: Backend = "pmap") -> PyTree:
    """The inverse of `place` for replicated and per_device parts: this process's host copy of a
    replicated value, every device's row of a per_device one (a collective with several processes)."""
    check_backend(backend)

    def get(kind: Kind, part: PyTree) -> PyTree:
        if kind == "replicated":
            return unreplicate(part, backend)
        if kind == "per_device":
            return jax.tree.map(to_host, part)
        raise ConfigError("`fetch` reads replicated and per_device values, not a batch.")

    return jax.tree.map(get, kinds, tree)


def check_divisible(batch_size: int, device_count: int) -> None:
    """Raises ConfigError unless a global batch splits evenly over the devices (the one copy of this check)."""
    if batch_size % device_count:
        raise ConfigError(
            "Batch size must be divisible by the number of devices: ", Arg("batch_size", batch_size),
            f" over {device_count} devices. Use a multiple of {device_count}."
        )


def sharded(devices: Sequence[jax.Device]) -> NamedSharding:
    """Slice i of the leading axis on `devices[i]`: batches, and params in the pmap layout."""
    return NamedSharding(mesh(devices), P(AXIS))


def replicate(tree: PyTree, devices: Sequence[jax.Device], backend: Backend = "pmap") -> PyTree:
    """One full copy of every leaf on each device, in the layout of `backend`.

    Under ``pmap`` leaf shape s becomes (k, *s): the `jax.device_put_replicated` contract. Every
    process passes the same host values (same seed); each places only its own devices' copies.
    `np.broadcast_to` makes the (k, *s) view without a k-fold copy on the host.
    """
    check_backend(backend)
    k = len(devices)
    sharding = sharded(devices) if backend == "pmap" else NamedSharding(mesh(devices), P())

    def put(leaf: Any) -> jax.Array:
        host = np.asarray(leaf)
        if backend == "pmap":
            host = np.broadcast_to(host[None], (k, *host.shape))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def unreplicate(tree: PyTree, backend: Backend = "pmap") -> PyTree:
    """This process's copy of replicated values, read from its first device (no communication)."""
    check_backend(backend)

    def first(x: jax.Array) -> jax.Array:
        data = min(x.addressable_shards, key=lambda s: (s.index[0].start or 0) if s.index else 0).data
        return data[0] if backend == "pmap" else data

    return jax.tree.map(first, tree)


def split_batch(
    images: np.ndarray, labels: np.ndarray, devices: Sequence[jax.Device], backend: Backend = "pmap"
) -> tuple[jax.Array, jax.Array]:
    """Splits a batch over `devices` on its leading axis: device i gets rows [i·B/k, (i+1)·B/k).

    The lesson's `split_batch` (under ``pmap``, (B, ...) becomes (k, B/k, ...)). With several
    processes, each passes its own rows of the global batch (`process_rows`).

    Raises:
      ConfigError: if the lengths differ, or the rows do not split evenly over this process's devices.
    """
    if len(images) != len(labels):
        raise ConfigError(f"`images` and `labels` differ in length: {len(images)} vs {len(labels)}.")
    return shard_rows(images, devices, backend), shard_rows(labels, devices, backend)


def shard_rows(rows: np.ndarray, devices: Sequence[jax.Device], backend: Backend = "pmap") -> jax.Array:
    """One global array of every process's `rows`, in the batch layout of `backend`.

    Raises:
      ConfigError: if the rows do not split evenly over this process's devices.
    """
    check_backend(backend)
    rows, k = np.asarray(rows), len(devices)
    local = sum(d.process_index == jax.process_index() for d in devices)
    batch_size = len(rows) * (k // max(local, 1))  # every process feeds an equal share
    process_rows(batch_size, devices)  # divisible, and this process's devices one contiguous block
    shape = (batch_size, *rows.shape[1:])
    if backend == "pmap":
        rows = rows.reshape(-1, batch_size // k, *rows.shape[1:])
        shape = (k, batch_size // k, *rows.shape[2:])
    if jax.process_count() == 1:
        return jax.device_put(rows, sharded(devices))
    return jax.make_array_from_process_local_data(sharded(devices), rows, shape)


def place_step_batches(rows: np.ndarray, devices: Sequence[jax.Device]) -> jax.Array:
    """S batches of one process's devices, (S, k, B/k, ...) with device i holding column i: what a
    `pmap` step unrolled S times in one call takes (`jdp.parallel.feeders`)."""
    return jax.device_put(rows, NamedSharding(mesh(devices), P(None, AXIS)))


def process_rows(batch_size: int, devices: Sequence[jax.Device]) -> slice:
    """The rows of every global batch of `batch_size` that this process loads and feeds.

    Process p holds mesh positions [p·k_p, (p+1)·k_p) and so rows [p·B/P, (p+1)·B/P): the slices
    of all processes tile the batch exactly (no overlap, no row lost), in the same order as on one
    process with all the devices.

    Raises:
      ConfigError: if `batch_size` does not divide evenly over `devices`.
      DeviceError: if this process's devices are not one contiguous block of `devices`.
    """
    check_divisible(batch_size, len(devices))
    per_device = batch_size // len(devices)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if not mine or mine != list(range(mine[0], mine[0] + len(mine))):
        raise DeviceError(
            f"Process {jax.process_index()}'s devices must form one contiguous block of the step's devices; "
            "order them by process, as `jdp.select_devices` does."
        )
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a step output on every process, e.g. all k per-device losses.

    With several processes this is a collective (every process must call it): a global array
    (shard_map) is gathered; a process-local one (what `jax.pmap` returns there) is concatenated
    in process order.
    """
    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def copies(tree: PyTree, k: int) -> PyTree:
    """The per_device host form of one value: k rows of every leaf, each the whole leaf (a view, no copy)."""
    return jax.tree.map(lambda leaf: np.broadcast_to(np.asarray(leaf)[None], (k, *np.shape(leaf))), tree)


def per_process(x: np.ndarray) -> np.ndarray:
    """Every process's `x` (same shape everywhere), stacked in process order: (P, ...) (a collective)."""
    if jax.process_count() == 1:
        return np.asarray(x)[None]
    return np.asarray(multihost_utils.process_allgather(x))
