"""The data-parallel train step, built once from (loss, optimizer, strategy, devices, backend).

Train step, per device: forward/backward on its shard of the batch (loss summed over the shard),
allreduce the gradients (sum over devices), divide by the FULL batch size, one optax update.
Every device applies the same update to the same params, so the replicas stay identical.
Two backends map that program over the devices, of one process or several (see `jdp.parallel.layout`):
`jax.pmap`, and `jax.jit(jax.shard_map(...))` over a 1-D mesh.
"""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.errors import ConfigError, check_positive
from jdp.parallel import allreduce as allreduce_lib
from jdp.parallel import zero
from jdp.parallel.allreduce import Allreduce
from jdp.parallel.layout import Backend, check_backend
from jdp.runtime.devices import AXIS, mesh

PyTree = Any
LossFn = Callable[[PyTree, jax.Array, jax.Array], jax.Array]
# (params, state, images, labels) -> (summed loss, new state): a model with state such as BatchNorm's statistics
StatefulLossFn = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[jax.Array, PyTree]]
# (params, opt_state, images, labels) -> (params, opt_state, per-device summed loss)
TrainStep = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[PyTree, PyTree, jax.Array]]


def make_train_step(
    loss_fn: LossFn | StatefulLossFn,
    optimizer: optax.GradientTransformation,
    allreduce: Allreduce | str,
    devices: Sequence[jax.Device],
    backend: Backend = "pmap",
    *,
    stateful: bool = False,
    segment: Callable[[str, Callable], Callable] = lambda name, fn: fn,
    accumulate: int = 1,
    shard_optimizer: bool = False,
) -> TrainStep:
    """Builds the data-parallel train step, mapped once over `devices` by `backend`.

    Both backends run the same per-device program (the strategy is the one and only sum of the
    gradients); they differ in how arrays are laid out (see `jdp.parallel.layout`):

    * ``pmap``: `jax.pmap`; params/opt_state (k, ...) with a leading device axis, batch (k, B/k, ...).
    * ``shard_map``: `jax.jit(jax.shard_map(...))` over a 1-D mesh; params/opt_state replicated with
      `P()`, batch (B, ...) sharded with `P('data')`.

    With either, `devices` may span several processes; `jax.pmap` then returns
    each process's part of its outputs, `jit` global arrays.

    Args:
      loss_fn: (params, images, labels) -> loss summed over the images; with `stateful`,
        (params, state, images, labels) -> (summed loss, new state), e.g. BatchNorm statistics.
      optimizer: applied to the mean gradient of the full batch.
      allreduce: how the per-device gradient sums are added up: a strategy or a registered name.
      devices: the devices the step runs on (the mesh, in order).
      backend: "pmap" or "shard_map".
      stateful: the step's first argument is {"params", "state"} (see `jdp.Model`): only "params"
        is differentiated and updated, "state" is replaced by the loss's new state.
      accumulate: N micro-batches per device: each device's shard is cut into N equal parts whose
        gradients are summed one after another (`accumulate_grads`) before the one allreduce.
      shard_optimizer: ZeRO: reduce-scatter the gradients, update each device's 1/k slice with its
        1/k of the optimizer state, all-gather the params (`jdp.parallel.zero`); opt_state is then
        laid out by `jdp.parallel.zero.shard_state`.
      segment: `segment(kind, fn) -> fn` wraps each of an "outside" strategy's three calls, kind
        "compute" or "communication" (e.g. to time them, `jdp.training.profile.Profiler.segment`).

    A stateful strategy (`allreduce.init`, e.g. PowerSGD's error feedback) keeps its per-device state
    in the step's opt_state: `{"optimizer": <the optimizer's state>, "allreduce": <its state>}`, the
    latter with leaves (k, ...), slice i on device i (`jdp.parallel.compress.init_state`), `pmap` only.

    Returns:
      step(params, opt_state, images, labels) -> (params, opt_state, losses): inputs placed with
      `jdp.replicate` / `jdp.split_batch` for `backend`, losses the per-device sums, shape (k,).
      params and opt_state are donated: do not reuse the arrays passed in.

    Raises:
      ConfigError: for an unknown backend, an "outside" strategy over devices of several processes,
        a shard that does not split into `accumulate` equal parts (when traced), or `shard_optimizer`
        with a strategy that has no reduce-scatter.
    """
    check_backend(backend)
    check_positive("--accumulate", accumulate)
    allreduce = allreduce_lib.get(allreduce)
    if allreduce.where == "outside" and any(d.process_index != jax.process_index() for d in devices):
        inside = ", ".join(allreduce_lib.names("inside"))
        raise ConfigError(
            f"`--allreduce {allreduce.name}` copies buffers between devices with `jax.device_put`, which only "
            f"reaches this process's devices, but the step spans {jax.process_count()} processes. "
            f"Use a collective strategy instead: {inside}."
        )
    if allreduce.init is not None and backend != "pmap":
        raise ConfigError(
            f"`{allreduce.name}` keeps different state on each device, which `--backend {backend}` cannot hold in "
            "its replicated `P()` layout. Use `--backend pmap`."
        )
    k = len(devices)

    def local_grads(variables, images, labels):
        """(loss, gradient sum over this device's shard, new model state or None)."""
        if accumulate > 1:
            return accumulate_grads(micro_grads, variables, images, labels, accumulate, stateful=stateful)
        return micro_grads(variables, images, labels)

    def micro_grads(variables, images, labels):
        if not stateful:
            return *jax.value_and_grad(loss_fn)(variables, images, labels), None
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            variables["params"], variables["state"], images, labels)
        return loss, grads, state

    def update(variables, opt_state, grad_sum, state, local_batch):
        params = variables["params"] if stateful else variables
        grads = jax.tree.map(lambda g: g / (local_batch * k), grad_sum)  # divide by the FULL batch
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return ({"params": params, "state": state} if stateful else params), opt_state

    def local_step(variables, opt_state, images, labels):
        loss, grads, state = local_grads(variables, images, labels)
        grads, opt_state, kept = _reduce(allreduce, grads, opt_state, AXIS)  # the one reduction over the devices
        variables, opt_state = update(variables, opt_state, grads, state, images.shape[0])
        return variables, _with_kept(opt_state, kept), loss

    if shard_optimizer:
        return zero.make_step(local_grads, optimizer, allreduce, devices, backend, stateful)
    if backend == "shard_map":
        return _shard_map_step(local_step, local_grads, update, allreduce, devices, segment)
    if allreduce.where == "inside":
        return jax.pmap(local_step, axis_name=AXIS, devices=devices, donate_argnums=(0, 1))
    p_grads = jax.pmap(local_grads, axis_name=AXIS, devices=devices)
    p_update = jax.pmap(
        lambda v, o, g, s, x: update(v, o, g, s, x.shape[0]),
        axis_name=AXIS, devices=devices, donate_argnums=(0, 1),
    )
    return _outside_step(p_grads, allreduce, p_update, segment)


# Whether XLA keeps one micro-batch's activations when the unrolled micro-batches are ordered by
# `lax.optimization_barrier` (measured with `memory_analysis()`: yes on JAX 0.12, no on 0.10.2).
BARRIER_ORDERS_MICRO_BATCHES = jax.__version_info__ >= (0, 12)


def accumulate_grads(grads_fn: Callable, variables: PyTree, images: jax.Array, labels: jax.Array,
                     micro_batches: int, *, stateful: bool = False) -> tuple[jax.Array, PyTree, PyTree]:
    """Sums `grads_fn` over `micro_batches` equal parts of a device's shard, one part after another.

    The loss is a sum, so the summed gradients of the parts are the gradient of the whole shard: the
    allreduce and the update that follow are those of one step on the whole batch. Only one part's
    activations are alive at a time: the parts are unrolled, each read through `lax.optimization_barrier`
    with the running sum, so XLA cannot start part t before part t−1's gradients exist (a `lax.scan`
    would bound memory too, but XLA's CPU convolutions run ~10x slower inside a loop). JAX 0.10's XLA
    ignores that order when it assigns buffers, so there the parts run in a `lax.scan`. A stateful
    model's state (BatchNorm statistics) is threaded from each part to the next, as N steps would.

    Args:
      grads_fn: (variables, images, labels) -> (summed loss, gradients, new state or None).
      variables: the params, or {"params", "state"} if `stateful`.
      images, labels: this device's shard, n rows.
      micro_batches: N, which must divide n.

    Returns:
      (loss summed over the shard, gradients summed over the shard, the last part's state or None).

    Raises:
      ConfigError: if n does not split into `micro_batches` equal parts.
    """
    n = images.shape[0]
    if n % micro_batches:
        raise ConfigError(
            f"`--accumulate {micro_batches}` cuts each device's {n} rows into {micro_batches} equal micro-batches, "
            f"which {n} does not allow: use a `--batch-size` that is a multiple of devices × {micro_batches}."
        )
    parts = jax.tree.map(lambda a: a.reshape(micro_batches, n // micro_batches, *a.shape[1:]), (images, labels))

    def add_part(carry, part):
        loss_sum, grad_sum, variables = carry
        loss, grads, state = grads_fn(variables, *part)
        variables = {**variables, "state": state} if stateful else variables
        return loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), variables  # 0 + g is g exactly

    zeros = jax.tree.map(jnp.zeros_like, variables["params"] if stateful else variables)
    carry = (jnp.zeros((), jnp.float32), zeros, variables)
    if BARRIER_ORDERS_MICRO_BATCHES:
        for t in range(micro_batches):  # unrolled
            part = jax.tree.map(lambda a: a[t], parts)
            # part t is read only once part t−1's gradients exist
            grad_sum, part = lax.optimization_barrier((carry[1], part))
            carry = add_part((carry[0], grad_sum, carry[2]), part)
    else:
        carry, _ = lax.scan(lambda carry, part: (add_part(carry, part), None), carry, parts)
    loss, grads, variables = carry
    return loss, grads, variables["state"] if stateful else None


def _outside_step(grads_fn, allreduce: Allreduce, update_fn, segment) -> TrainStep:
    """The step of an "outside" strategy: three calls, with the allreduce's transfers between them."""
    grads_fn, update_fn = segment("compute", grads_fn), segment("compute", update_fn)
    reduce_grads = segment("communication", partial(_reduce, allreduce))

    def step(variables, opt_state, images, labels):
        loss, grads, state = grads_fn(variables, images, labels)  # per-device gradients leave the device step
        grads, opt_state, kept = reduce_grads(grads, opt_state)  # explicit transfers between devices
        variables, opt_state = update_fn(variables, opt_state, grads, state, images)
        return variables, _with_kept(opt_state, kept), loss

    return step


def _reduce(allreduce: Allreduce, grads: PyTree, opt_state: PyTree, *axis: str) -> tuple[PyTree, PyTree, PyTree]:
    """(the summed gradients, the optimizer's state, the strategy's new state or None if it keeps none)."""
    if allreduce.init is None:
        return allreduce.fn(grads, *axis), opt_state, None
    grads, kept = allreduce.fn(grads, opt_state["allreduce"], *axis)
    return grads, opt_state["optimizer"], kept


def _with_kept(opt_state: PyTree, kept: PyTree) -> PyTree:
    """The step's opt_state: the optimizer's, with a stateful strategy's state beside it."""
    return opt_state if kept is None else {"optimizer": opt_state, "allreduce": kept}


def _shard_map_step(local_step, local_grads, update, allreduce: Allreduce,
                    devices: Sequence[jax.Device], segment) -> TrainStep:
    """The step as `jit(shard_map(...))`: params `P()`, batch `P('data')`.

    The double count. Inside `shard_map` with `check_vma=True`, params specified `P()` are typed
    invariant over the axis and the batch varying; differentiating the loss w.r.t. such params makes
    autodiff insert the transpose of the implicit broadcast, a psum: the gradients come out ALREADY
    summed over devices, and any strategy on top sums them again (psum: k times the gradient).
    jdp's strategies are the object of study and each must be the one and only reduction, applied to
    each device's local gradient sum; strategies built from `ppermute` (ring, tree) also return values
    that are equal on every device but typed varying, which `check_vma=True` refuses to return as `P()`.
    So the step is mapped with `check_vma=False`: autodiff adds no psum, exactly as under `jax.pmap`
    (itself `jit(shard_map(..., check_vma=False))`). `test_backends.py` fails if gradients are summed twice.

    "Outside" strategies keep params `P()` too: the per-device gradients leave the step as one (k, ...)
    array sharded `P('data')` (slice i on device i), the layout those strategies consume and return;
    the update then takes each device's slice. Their results are bit-identical on every device, which
    is what lets the update return params as `P()` without a check. Model state (synchronised
    BatchNorm statistics) is equal on every device too, and returned `P()` likewise.
    """
    m = mesh(devices)
    batch, replicated = P(AXIS), P()

    def shard_map(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    if allreduce.where == "inside":

        def local_step_stacked(variables, opt_state, images, labels):
            variables, opt_state, loss = local_step(variables, opt_state, images, labels)
            return variables, opt_state, loss[None]

        mapped = shard_map(local_step_stacked, (replicated, replicated, batch, batch), (replicated, replicated, batch))
        return jax.jit(mapped, donate_argnums=(0, 1))

    def local_grads_stacked(variables, images, labels):
        loss, grads, state = local_grads(variables, images, labels)
        return loss[None], jax.tree.map(lambda g: g[None], grads), state  # stacked: (k, ...) over the devices

    def local_update(variables, opt_state, grads, state, images):
        return update(variables, opt_state, jax.tree.map(lambda g: g[0], grads), state, images.shape[0])

    s_grads = jax.jit(shard_map(local_grads_stacked, (replicated, batch, batch), (batch, batch, replicated)))
    s_update = jax.jit(
        shard_map(local_update, (replicated, replicated, batch, replicated, batch), (replicated, replicated)),
        donate_argnums=(0, 1),
    )
    return _outside_step(s_grads, allreduce, s_update, segment)
