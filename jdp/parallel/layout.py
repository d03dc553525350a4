"""Where arrays live: one copy of the params per device, and batches split over the devices.

These replace the removed `jax.device_put_replicated` / `jax.device_put_sharded`, for both
train-step backends (see `jdp.parallel.step`) and for one process or many:

* ``pmap``: a leading device axis of size k, sharded over it: params (k, ...), batch (k, B/k, ...).
  This is the layout `jax.pmap` consumes and produces, so arrays flow between steps without copies.
* ``shard_map``: the natural shapes: params replicated with `P()`, batch (B, ...) with `P('data')`.

Every function returns global `jax.Array`s over the 1-D mesh of `jdp.runtime.devices.mesh`: shard
i lives on device i. Devices are ordered by (process, id), so process p owns a contiguous block of
the mesh and therefore a contiguous block of rows of every global batch (`process_rows`): with
several processes each passes its own rows, and every process the same replicated values.
"""

from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.errors import ConfigError, DeviceError
from jdp.runtime.devices import AXIS, mesh

PyTree = Any
Backend = Literal["pmap", "shard_map"]
BACKENDS: tuple[Backend, ...] = ("pmap", "shard_map")


def check_backend(backend: str) -> None:
    """Raises ConfigError unless `backend` is one of BACKENDS."""
    if backend not in BACKENDS:
        raise ConfigError(f"Unknown `--backend {backend}`; choose one of: {', '.join(BACKENDS)}.")


def check_divisible(batch_size: int, device_count: int) -> None:
    """Raises ConfigError unless a global batch splits evenly over the devices (the one copy of this check)."""
    if batch_size % device_count:
        raise ConfigError(
            f"Batch size must be divisible by the number of devices: `--batch-size {batch_size}` over "
            f"{device_count} devices. Use a multiple of {device_count}."
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
