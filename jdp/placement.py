"""Where arrays live: one copy of the params per device, and batches split over devices.

These replace the removed `jax.device_put_replicated` / `jax.device_put_sharded`. Every array they
return is one global `jax.Array` with a leading device axis of size k, sharded over a 1-D mesh
whose axis is `AXIS`: shard i lives on device i. That is exactly the layout `jax.pmap` consumes
and produces, so arrays flow between mapped steps without copies.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jdp.errors import ConfigError

AXIS = "data"  # the one device-axis name used by every mapped function and collective

PyTree = Any


def device_axis_sharding(devices: Sequence[jax.Device]) -> NamedSharding:
    """Sharding that puts slice i of the leading axis on `devices[i]`."""
    return NamedSharding(Mesh(np.asarray(devices), (AXIS,)), P(AXIS))


def replicate(tree: PyTree, devices: Sequence[jax.Device]) -> PyTree:
    """One full copy of every leaf on each device: leaf shape s becomes (k, *s).

    The `jax.device_put_replicated` contract. `np.broadcast_to` makes a (k, *s) view without copying
    on the host; `jax.device_put` then sends each device only its own slice.
    """
    sharding = device_axis_sharding(devices)

    def put(leaf: Any) -> jax.Array:
        host = np.asarray(leaf)
        return jax.device_put(np.broadcast_to(host[None], (len(devices), *host.shape)), sharding)

    return jax.tree.map(put, tree)


def unreplicate(tree: PyTree) -> PyTree:
    """The copy held by the first device, without gathering the other copies."""
    return jax.tree.map(lambda x: _first_shard(x)[0], tree)


def _first_shard(x: jax.Array) -> jax.Array:
    for shard in x.addressable_shards:
        if shard.index[0].start in (0, None):
            return shard.data
    raise ValueError("The array has no addressable shard holding index 0 of its device axis.")


def split_batch(
    images: np.ndarray, labels: np.ndarray, devices: Sequence[jax.Device]
) -> tuple[jax.Array, jax.Array]:
    """Splits a batch evenly over `devices` on its leading axis: (B, ...) becomes (k, B/k, ...).

    Device i receives rows [i·B/k, (i+1)·B/k), as in the lesson's `split_batch`.

    Raises:
      ConfigError: if B is not divisible by the number of devices, or the lengths differ.
    """
    if len(images) != len(labels):
        raise ConfigError(f"`images` and `labels` differ in length: {len(images)} vs {len(labels)}.")
    return shard_leading(images, devices), shard_leading(labels, devices)


def shard_leading(x: np.ndarray, devices: Sequence[jax.Device]) -> jax.Array:
    """(B, ...) → (k, B/k, ...) with slice i on device i (the `jax.device_put_sharded` contract)."""
    k, batch = len(devices), x.shape[0]
    if batch % k:
        raise ConfigError(
            f"Batch size must be divisible by the number of devices: {batch} rows over {k} devices. "
            f"Use a batch size that is a multiple of {k}."
        )
    return jax.device_put(np.asarray(x).reshape(k, batch // k, *x.shape[1:]), device_axis_sharding(devices))
