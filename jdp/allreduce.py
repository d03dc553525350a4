"""Allreduce strategies: a gradient pytree in, its sum over devices on every device out.

Two places an allreduce can run, and so two kinds of strategy:

* ``inside`` the mapped step, as a collective over the device axis: ``fn(tree, axis_name)``,
  called on each device's local tree (no leading device axis).
* ``outside`` it, between two mapped functions, moving buffers with explicit ``jax.device_put``:
  ``fn(tree)``, where every leaf is a global array of shape (k, ...) with slice i on device i.
  This is how the lesson's allreduce works: gradients leave the device computation, are copied,
  summed, copied back.

Every strategy leaves bit-identical values on all devices, so replicas never drift apart.
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
from jax import lax

from jdp.errors import ConfigError

PyTree = Any


class Allreduce(NamedTuple):
    """A named allreduce algorithm.

    Attributes:
      name: what the CLI calls it.
      where: "inside" (fn(tree, axis_name), a collective in the mapped step) or "outside"
        (fn(tree) on global arrays with a leading device axis, between mapped functions).
      fn: the algorithm.
    """

    name: str
    where: Literal["inside", "outside"]
    fn: Callable[..., PyTree]


def psum(tree: PyTree, axis_name: str) -> PyTree:
    """XLA's all-reduce collective over `axis_name`; the reference every other strategy must equal."""
    return lax.psum(tree, axis_name)  # one all-reduce per leaf (XLA may combine them)


def manual(tree: PyTree) -> PyTree:
    """The lesson's star allreduce: copy every device's buffer to device 0, add there, copy back.

    Device 0 receives (k−1)·N and sends (k−1)·N bytes for a buffer of N bytes: the root is the
    bottleneck, which is why ring allreduce (Patarasuk & Yuan 2009) scales better.
    """
    return jax.tree.map(_star_sum, tree)


def _star_sum(x: jax.Array) -> jax.Array:
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    root = shards[0].device
    total = shards[0].data
    for shard in shards[1:]:
        total = total + jax.device_put(shard.data, root)  # copy device i → device 0, add on device 0
    copies = [jax.device_put(total, s.device) for s in shards]  # copy the sum back to every device
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)


STRATEGIES: dict[str, Allreduce] = {
    "psum": Allreduce("psum", "inside", psum),
    "manual": Allreduce("manual", "outside", manual),
}


def get(name: str) -> Allreduce:
    """The strategy called `name`.

    Raises:
      ConfigError: for an unknown name, listing the known ones.
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(
            f"Unknown allreduce strategy `{name}`; choose one of: {', '.join(STRATEGIES)}."
        ) from None
