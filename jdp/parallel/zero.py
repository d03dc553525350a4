"""Sharded optimizer state (ZeRO stage 2): reduce-scatter the gradients, update 1/k, all-gather the params.

Replicated data parallelism keeps k full copies of the optimizer state: AdamW's two moments are
twice the params, on every device. ZeRO (Rajbhandari et al. 2020) keeps one copy, split:

1. the gradients are raveled into one flat buffer per dtype, zero-padded to k equal slices of c
   elements, and reduce-scattered: device i receives the SUM over devices of slice i only (stage 2:
   the reduced gradient takes 1/k of the memory; stage 1 alone would allreduce and drop 15/16);
2. device i updates slice i of the params with slice i of the optimizer state, which is all the
   optimizer state it holds (stage 1);
3. the new slices are all-gathered, so every device again holds all the params.

A reduce-scatter followed by an all-gather is exactly what the ring allreduce does, so this sends
the same 2(k−1)/k·N bytes per device as the replicated ring; it only moves the update between the
two halves. That works for elementwise optimizers (SGD, momentum, AdamW: `jdp.training.optimizers`);
one that reduces over all elements (global-norm clipping) would need a psum of the slices' norms.

The halves come from the project's own algorithms (`COLLECTIVES`): XLA's `psum_scatter`/`all_gather`,
the ring's two halves from `ppermute`, and the same from explicit `jax.device_put` copies (ring and
the lesson's star). The padding is zeros: its gradient, state and params stay exactly zero.

Layout of the sharded optimizer state, under both backends: every leaf stacked over the devices,
(k, ...), row i on device i, sharded `P('data')`: slice-shaped leaves (AdamW's mu, nu) are (k, c),
scalars (AdamW's count) (k,) with the same value in every row. Its host form (`gather_state`,
what checkpoints store) is `optimizer.init` of the unpadded flat buffers, independent of k: a run
resumes on any device count, re-padded and re-sliced (`shard_state`).
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.errors import ConfigError
from jdp.parallel import allreduce as allreduce_lib
from jdp.parallel.allreduce import Allreduce, Layout, _from_buckets, _layout, _to_buckets
from jdp.parallel.layout import Backend, sharded, to_host
from jdp.runtime.devices import AXIS, mesh

PyTree = Any


class Collectives(NamedTuple):
    """A reduce-scatter and the matching all-gather, as one allreduce strategy splits into them.

    Attributes:
      name: the allreduce strategy they belong to (`--allreduce NAME --shard-optimizer`).
      reduce_scatter: "inside": `fn(flat, axis_name)`, a 1-D buffer of k·c elements → the (c,) sum of
        slice i on device i. "outside": `fn(x)` on a global (k, k·c) array → (k, c).
      all_gather: "inside": `fn(mine, axis_name)`, (c,) → (k·c,), the slices in order.
        "outside": (k, c) → (k, k·c).
      where: "inside" (collectives in the mapped step) or "outside" (copies between mapped calls).
    """

    name: str
    reduce_scatter: Callable[..., jax.Array]
    all_gather: Callable[..., jax.Array]
    where: Literal["inside", "outside"] = "inside"


def psum_scatter(flat: jax.Array, axis_name: str) -> jax.Array:
    """XLA's reduce-scatter: device i gets the sum over devices of slice i."""
    return lax.psum_scatter(flat, axis_name, tiled=True)


def all_gather(mine: jax.Array, axis_name: str) -> jax.Array:
    """XLA's all-gather: every device gets every device's slice, in device order."""
    return lax.all_gather(mine, axis_name, tiled=True)


COLLECTIVES: dict[str, Collectives] = {  # keyed by the allreduce strategy they split
    "psum": Collectives("psum", psum_scatter, all_gather),
    "ring": Collectives("ring", allreduce_lib.ring_reduce_scatter, allreduce_lib.ring_all_gather),
    "manual": Collectives("manual", allreduce_lib.manual_reduce_scatter, allreduce_lib.manual_all_gather, "outside"),
    "manual_ring": Collectives("manual_ring", allreduce_lib.manual_ring_reduce_scatter,
                               allreduce_lib.manual_ring_all_gather, "outside"),
}


def get(strategy: Allreduce | str) -> Collectives:
    """The reduce-scatter and all-gather of the allreduce `strategy`.

    Raises:
      ConfigError: if it has none (tree, fused or your own strategies), naming those that do.
    """
    name = strategy if isinstance(strategy, str) else strategy.name
    if name not in COLLECTIVES:
        raise ConfigError(
            f"`--shard-optimizer` splits the allreduce into a reduce-scatter and an all-gather, which "
            f"`--allreduce {name}` does not provide; use one of: {', '.join(COLLECTIVES)}."
        )
    return COLLECTIVES[name]


class Flat(NamedTuple):
    """How a params pytree is raveled into one flat buffer per dtype, padded to k slices of `chunks[j]`.

    Attributes:
      treedef: the params' tree structure.
      layout: which leaves go into which dtype's buffer (the layout `jdp.fused` uses).
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
        buffers = _to_buckets(jax.tree.leaves(tree), self.layout, None, lead=0)
        return [jnp.pad(b, (0, self.k * c - n)) for b, c, n in zip(buffers, self.chunks, self.sizes, strict=True)]

    def unflatten(self, buffers: Sequence[jax.Array]) -> PyTree:
        """The inverse of `flatten`: the padding cut, the leaves in their shapes."""
        cut = [b[:n] for b, n in zip(buffers, self.sizes, strict=True)]
        return jax.tree.unflatten(self.treedef, _from_buckets(cut, self.layout, None, lead=0))

    def slices(self, tree: PyTree, index: jax.Array) -> list[jax.Array]:
        """Slice `index` (c_j elements) of each buffer of `tree`."""
        return [lax.dynamic_slice_in_dim(b, index * c, c) for b, c in zip(self.flatten(tree), self.chunks, strict=True)]


def plan(params: PyTree, k: int) -> Flat:
    """The flat layout of `params` (arrays or `jax.ShapeDtypeStruct`s) over k devices."""
    leaves, treedef = jax.tree.flatten(params)
    layout = _layout(leaves, lead=0)
    return Flat(treedef, layout, tuple(sum(math.prod(s) for _, s in entries) for _, entries in layout), k)


def _state_shapes(optimizer: optax.GradientTransformation, flat: Flat, sizes: Sequence[int]) -> list[Any]:
    """The leaves of `optimizer.init` over flat buffers of `sizes` (shapes and dtypes only)."""
    buffers = [jax.ShapeDtypeStruct((n,), dtype) for (dtype, _), n in zip(flat.layout, sizes, strict=True)]
    return jax.tree.leaves(jax.eval_shape(optimizer.init, buffers))


def slice_leaves(optimizer: optax.GradientTransformation, flat: Flat) -> list[bool]:
    """Which leaves of the optimizer state are per-element (a slice of it per device), in leaf order.

    A leaf whose shape follows the buffers' length is per-element (AdamW's moments); one whose shape
    does not is the same on every device (AdamW's step count).
    """
    one = _state_shapes(optimizer, flat, flat.chunks)
    other = _state_shapes(optimizer, flat, [c + 1 for c in flat.chunks])
    return [a.shape != b.shape for a, b in zip(one, other, strict=True)]


def host_state(optimizer: optax.GradientTransformation, params: PyTree) -> PyTree:
    """The optimizer state in its host form: `optimizer.init` over the unpadded flat buffers of `params`."""
    return optimizer.init(plan(params, 1).flatten(params))


def shard_state(optimizer: optax.GradientTransformation, state: PyTree, params: PyTree,
                devices: Sequence[jax.Device]) -> PyTree:
    """Places the host form of the state on `devices`: slice i of each per-element leaf on device i.

    Every process passes the same host values; each places only its own devices' rows.
    """
    flat = plan(params, len(devices))
    leaves, treedef = jax.tree.flatten(state)
    placed = []
    for leaf, per_element in zip(leaves, slice_leaves(optimizer, flat), strict=True):
        host = np.asarray(leaf)
        if per_element:
            c = -(-host.size // flat.k) or 1
            host = np.pad(host, (0, flat.k * c - host.size)).reshape(flat.k, c)
        else:
            host = np.broadcast_to(host[None], (flat.k, *host.shape))
        placed.append(jax.make_array_from_callback(host.shape, sharded(devices), lambda index, h=host: h[index]))
    return jax.tree.unflatten(treedef, placed)


def init_state(optimizer: optax.GradientTransformation, params: PyTree, devices: Sequence[jax.Device]) -> PyTree:
    """The initial optimizer state of `params`, sharded over `devices`: what `make_train_step(...,
    shard_optimizer=True)` takes as `opt_state` (the counterpart of `jdp.replicate(optimizer.init(params))`)."""
    return shard_state(optimizer, host_state(optimizer, params), params, devices)


def gather_state(optimizer: optax.GradientTransformation, state: PyTree, params: PyTree, k: int) -> PyTree:
    """The host form of a sharded state (the inverse of `shard_state`); a collective with several processes."""
    flat = plan(params, k)
    leaves, treedef = jax.tree.flatten(state)
    per_element = slice_leaves(optimizer, flat)
    real = [leaf.shape for leaf in _state_shapes(optimizer, flat, flat.sizes)]
    out = []
    for leaf, sliced, shape in zip(leaves, per_element, real, strict=True):
        rows = to_host(leaf)  # (k, ...): every device's row
        out.append(rows.reshape(-1)[: math.prod(shape)].reshape(shape) if sliced else rows[0])
    return jax.tree.unflatten(treedef, out)


def replicated_part(optimizer: optax.GradientTransformation, state: PyTree, params: PyTree, k: int) -> list[Any]:
    """The leaves of a sharded state that every device must hold identically (what the replica check compares)."""
    flat = plan(params, k)
    return [leaf for leaf, sliced in zip(jax.tree.leaves(state), slice_leaves(optimizer, flat), strict=True)
            if not sliced]


# --- the step -----------------------------------------------------------------------------------


Kind = Literal["replicated", "stacked", "batch"]


def mapped(fn: Callable, backend: Backend, devices: Sequence[jax.Device], ins: Sequence[Kind],
           outs: Sequence[Kind], donate: tuple[int, ...] = ()) -> Callable:
    """`fn` mapped over `devices` by `backend`, its arguments and results of three kinds of layout.

    "replicated": the same value on every device (`jdp.replicate`'s layout); "stacked": a different
    value per device, (k, ...) row i on device i, seen by `fn` without the device axis; "batch": the
    rows of a batch (`jdp.split_batch`'s layout). Under `pmap` all three are (k, ...); under
    `shard_map` they are `P()`, `P('data')` with the axis dropped and restored, and `P('data')`.
    """
    if backend == "pmap":
        return jax.pmap(fn, axis_name=AXIS, devices=devices, donate_argnums=donate)

    def local(*args):
        args = [jax.tree.map(lambda x: x[0], a) if kind == "stacked" else a for a, kind in zip(args, ins, strict=True)]
        results = fn(*args)
        return tuple(jax.tree.map(lambda x: x[None], r) if kind == "stacked" else r
                     for r, kind in zip(results, outs, strict=True))

    spec = {"replicated": P(), "stacked": P(AXIS), "batch": P(AXIS)}
    return jax.jit(jax.shard_map(local, mesh=mesh(devices), in_specs=tuple(spec[kind] for kind in ins),
                                 out_specs=tuple(spec[kind] for kind in outs), check_vma=False),
                   donate_argnums=donate)


def make_step(local_grads: Callable, optimizer: optax.GradientTransformation, strategy: Allreduce,
              devices: Sequence[jax.Device], backend: Backend, stateful: bool) -> Callable:
    """The ZeRO train step; `jdp.make_train_step(..., shard_optimizer=True)` is its public face.

    Args:
      local_grads: (variables, images, labels) -> (summed loss, gradient sum over this device's
        shard, new model state or None), as `jdp.make_train_step` builds it.
      optimizer: an elementwise optax optimizer.
      strategy: the allreduce whose halves to use (see `get`).
      devices, backend: as for `jdp.make_train_step`.
      stateful: variables are {"params", "state"}.

    Returns:
      step(variables, opt_state, images, labels) -> (variables, opt_state, losses): variables
      replicated, opt_state sharded (`shard_state`), both donated.
    """
    collectives, k = get(strategy), len(devices)

    def params_of(variables):
        return variables["params"] if stateful else variables

    def with_params(variables, params, state):
        return {"params": params, "state": state} if stateful else params

    def update(variables, opt_state, grad_slices, local_batch, index):
        """Slice `index` of the params, updated with this device's state and summed gradient slice."""
        params = params_of(variables)
        grads = [g / (local_batch * k) for g in grad_slices]  # divide by the FULL batch
        mine = plan(params, k).slices(params, index)
        updates, opt_state = optimizer.update(grads, opt_state, mine)
        return optax.apply_updates(mine, updates), opt_state

    if collectives.where == "inside":

        def local_step(variables, opt_state, images, labels):
            loss, grads, state = local_grads(variables, images, labels)
            flat = plan(grads, k)
            reduced = [collectives.reduce_scatter(b, AXIS) for b in flat.flatten(grads)]  # sum of my slice
            mine, opt_state = update(variables, opt_state, reduced, images.shape[0], lax.axis_index(AXIS))
            params = flat.unflatten([collectives.all_gather(m, AXIS) for m in mine])  # every slice, everywhere
            return with_params(variables, params, state), opt_state, loss

        return mapped(local_step, backend, devices, ("replicated", "stacked", "batch", "batch"),
                      ("replicated", "stacked", "stacked"), donate=(0, 1))

    def local_buffers(variables, images, labels):
        loss, grads, state = local_grads(variables, images, labels)
        return loss, plan(grads, k).flatten(grads), state

    def local_update(variables, opt_state, reduced, images):
        return update(variables, opt_state, reduced, images.shape[0], lax.axis_index(AXIS))

    def local_assemble(variables, gathered, state):
        return (with_params(variables, plan(params_of(variables), k).unflatten(gathered), state),)

    p_buffers = mapped(local_buffers, backend, devices, ("replicated", "batch", "batch"),
                       ("stacked", "stacked", "replicated"))
    p_update = mapped(local_update, backend, devices, ("replicated", "stacked", "stacked", "batch"),
                      ("stacked", "stacked"), donate=(1,))
    p_assemble = mapped(local_assemble, backend, devices, ("replicated", "stacked", "replicated"),
                        ("replicated",), donate=(0,))

    def step(variables, opt_state, images, labels):
        loss, buffers, state = p_buffers(variables, images, labels)
        reduced = [collectives.reduce_scatter(b) for b in buffers]  # explicit copies between devices
        mine, opt_state = p_update(variables, opt_state, reduced, images)
        gathered = [collectives.all_gather(m) for m in mine]
        (variables,) = p_assemble(variables, gathered, state)
        return variables, opt_state, loss

    return step
