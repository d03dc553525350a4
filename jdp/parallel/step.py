"""The data-parallel train step, built once from (loss, optimizer, strategy, devices, backend).

Per device: forward/backward on its shard of the batch (loss summed over the shard), allreduce
the gradients (sum over devices), divide by the FULL batch size, one optax update. Every device
applies the same update to the same params, so the replicas stay identical. With the optimizer
sharded (ZeRO, Rajbhandari et al. 2020), the allreduce is split into its halves and the update
runs between them on each device's 1/k slice. `jdp.parallel.layout.map_over_devices` maps the
per-device program with either backend; an "outside" strategy runs between mapped calls. Under a
local sync mode (`jdp.parallel.sync`) each device steps alone, on its own params, until they meet.
"""

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from jdp.errors import ConfigError, check_positive
from jdp.parallel import allreduce as allreduce_lib
from jdp.parallel.buckets import plan
from jdp.parallel.layout import Backend, check_backend, map_over_devices
from jdp.parallel.opt_state import OptState
from jdp.parallel.strategy import Allreduce
from jdp.parallel.sync import Sync
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax

LossFn = Callable[[PyTree, jax.Array, jax.Array], jax.Array]
# (params, state, images, labels) -> (summed loss, new state): a model with state such as BatchNorm's statistics
StatefulLossFn = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[jax.Array, PyTree]]
# (params, opt_state, images, labels) -> (params, opt_state, per-device summed loss)
TrainStep = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[PyTree, PyTree, jax.Array]]
Segment = Callable[[str, Callable], Callable]


def make_train_step(
    loss_fn: LossFn | StatefulLossFn,
    optimizer: "optax.GradientTransformation",
    allreduce: Allreduce | str,
    devices: Sequence[jax.Device],
    backend: Backend = "pmap",
    *,
    stateful: bool = False,
    segment: Segment = lambda name, fn: fn,
    accumulate: int = 1,
    shard_optimizer: bool = False,
    sync: Sync | None = None,
) -> TrainStep:
    """Builds the data-parallel train step, mapped once over `devices` by `backend`.

    Both backends run the same per-device program (the strategy is the one and only sum of the
    gradients); they differ in how arrays are laid out (see `jdp.parallel.layout`):

    * ``pmap``: params/opt_state (k, ...) with a leading device axis, batch (k, B/k, ...).
    * ``shard_map``: params/opt_state replicated with `P()`, batch (B, ...) sharded with `P('data')`.

    With either, `devices` may span several processes.

    Args:
      loss_fn: (params, images, labels) -> loss summed over the images; with `stateful`,
        (params, state, images, labels) -> (summed loss, new state), e.g. BatchNorm statistics.
      optimizer: applied to the mean gradient of the full batch.
      allreduce: how the per-device gradient sums are added up: a strategy or a registered name.
      devices: the devices the step runs on (the mesh, in order).
      backend: "pmap" or "shard_map".
      stateful: the step's first argument is {"params", "state"} (see `jdp.Model`): only "params"
        is differentiated and updated, "state" is replaced by the loss's new state.
      segment: `segment(kind, fn) -> fn` wraps each call of an "outside" strategy's step, kind
        "compute" or "communication" (e.g. to time them, `jdp.training.profile.Profiler.segment`).
      accumulate: N micro-batches per device: each device's shard is cut into N equal parts whose
        gradients are summed one after another (`accumulate_grads`) before the one allreduce.
      shard_optimizer: ZeRO: reduce-scatter the gradients with the strategy's first half, update
        each device's 1/k slice with its 1/k of the optimizer state, all-gather the params with the
        second half. The strategy must have halves (`Allreduce.has_halves`).
      sync: a local mode (`jdp.parallel.sync`): no allreduce in the step; each device updates its own
        params (`per_device`) with the mean gradient of its own shard and its own optimizer state,
        and `jdp.parallel.sync.make_sync` makes them meet. None or every-step: the step above.

    The optimizer state is that of `jdp.parallel.opt_state.OptState`: replicated, sharded, or with
    a stateful strategy's per-device state beside the optimizer's (`pmap` only).

    Returns:
      step(params, opt_state, images, labels) -> (params, opt_state, losses): inputs placed with
      `jdp.replicate` / `jdp.split_batch` for `backend`, losses the per-device sums, shape (k,).
      params and opt_state are donated: do not reuse the arrays passed in.

    Raises:
      ConfigError: for an unknown backend, a strategy this step cannot run (see `check_strategy`), or
        a shard that does not split into `accumulate` equal parts (when traced).
    """
    import optax  # here, not at the top: `import jdp` stays light

    check_backend(backend)
    check_positive("accumulate", accumulate)
    strategy = allreduce_lib.get(allreduce)
    check_strategy(strategy, devices, backend, shard_optimizer)
    local = sync is not None and sync.local
    if local and shard_optimizer:
        raise ConfigError(f"`sync={sync.name}` keeps different params on each device; `shard_optimizer=True` "
                          "needs them identical. Drop one of them.")
    k = len(devices)
    opt = OptState(optimizer, None, k, sharded=shard_optimizer, strategy=strategy, local=local,
                   sync_init=sync.init if local else None)

    def params_of(variables):
        return variables["params"] if stateful else variables

    def with_params(variables, params, state):
        return {"params": params, "state": state} if stateful else params

    def micro_grads(variables, images, labels):
        if not stateful:
            return *jax.value_and_grad(loss_fn)(variables, images, labels), None
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            variables["params"], variables["state"], images, labels)
        return loss, grads, state

    def local_grads(variables, images, labels):
        """(loss, gradient sum over this device's shard, new model state or None)."""
        if accumulate > 1:
            return accumulate_grads(micro_grads, variables, images, labels, accumulate, stateful=stateful)
        return micro_grads(variables, images, labels)

    def apply(params, optimizer_state, grad_sums, local_batch, devices_summed=k):
        grads = jax.tree.map(lambda g: g / (local_batch * devices_summed), grad_sums)  # divide by the batch summed
        updates, optimizer_state = optimizer.update(grads, optimizer_state, params)
        return optax.apply_updates(params, updates), optimizer_state

    if local:

        def own_step(variables, opt_state, images, labels):
            optimizer_state, kept = opt.split(opt_state)
            loss, grads, state = local_grads(variables, images, labels)
            params, optimizer_state = apply(params_of(variables), optimizer_state, grads, images.shape[0], 1)
            opt_state = opt.join(optimizer_state, kept, opt.sync_state(opt_state))
            return with_params(variables, params, state), opt_state, loss

        return map_over_devices(own_step, devices, backend, ("per_device", opt.kind, "batch", "batch"),
                                ("per_device", opt.kind, "per_device"), donate=(0, 1))

    if shard_optimizer:
        return _sharded_step(strategy, opt, local_grads, apply, params_of, with_params, devices, backend, segment)

    def update(variables, optimizer_state, grads, state, images):
        params, optimizer_state = apply(params_of(variables), optimizer_state, grads, images.shape[0])
        return with_params(variables, params, state), optimizer_state

    if strategy.where == "inside":

        def local_step(variables, opt_state, images, labels):
            optimizer_state, kept = opt.split(opt_state)
            loss, grads, state = local_grads(variables, images, labels)
            grads, kept = strategy.reduce(grads, kept, AXIS)  # the one reduction over the devices
            variables, optimizer_state = update(variables, optimizer_state, grads, state, images)
            return variables, opt.join(optimizer_state, kept), loss

        return map_over_devices(local_step, devices, backend, ("replicated", opt.kind, "batch", "batch"),
                                ("replicated", opt.kind, "per_device"), donate=(0, 1))

    p_grads = segment("compute", map_over_devices(local_grads, devices, backend, ("replicated", "batch", "batch"),
                                                  ("per_device", "per_device", "replicated")))
    p_update = segment("compute", map_over_devices(
        update, devices, backend, ("replicated", opt.optimizer_kind, "per_device", "replicated", "batch"),
        ("replicated", opt.optimizer_kind), donate=(0, 1)))
    reduce = segment("communication", strategy.reduce)

    def step(variables, opt_state, images, labels):
        optimizer_state, kept = opt.split(opt_state)
        loss, grads, state = p_grads(variables, images, labels)  # per-device gradients leave the device step
        grads, kept = reduce(grads, kept)  # explicit transfers between devices
        variables, optimizer_state = p_update(variables, optimizer_state, grads, state, images)
        return variables, opt.join(optimizer_state, kept), loss

    return step


def check_strategy(strategy: Allreduce, devices: Sequence[jax.Device], backend: Backend,
                   shard_optimizer: bool = False) -> None:
    """Raises ConfigError unless the train step can run `strategy` over `devices` with `backend`.

    An "outside" strategy copies with `jax.device_put`, which reaches this process's devices only; a
    stateful one keeps per-device state, which `shard_map`'s replicated `P()` step does not hold; the
    sharded optimizer needs a strategy's halves, and carries no per-device strategy state.
    """
    if strategy.where == "outside" and any(d.process_index != jax.process_index() for d in devices):
        inside = ", ".join(allreduce_lib.names("inside"))
        raise ConfigError(
            f"`allreduce={strategy.name}` copies buffers between devices with `jax.device_put`, which only "
            f"reaches this process's devices, but the step spans {jax.process_count()} processes. "
            f"Use a collective strategy instead: {inside}."
        )
    if strategy.stateful and backend != "pmap":
        raise ConfigError(
            f"`{strategy.name}` keeps different state on each device, which `backend={backend}` cannot hold in "
            "its replicated `P()` layout. Use `backend=pmap`."
        )
    if shard_optimizer and (not strategy.has_halves or strategy.stateful):
        raise ConfigError(
            f"`shard_optimizer=True` splits the allreduce into a reduce-scatter and an all-gather, which "
            f"`allreduce={strategy.name}` does not provide; use one of: {', '.join(allreduce_lib.names(halves=True))}, "
            "or give your strategy `reduce_scatter` and `all_gather` (see `jdp.Allreduce`)."
        )


def _sharded_step(strategy: Allreduce, opt: OptState, local_grads: Callable, apply: Callable, params_of: Callable,
                  with_params: Callable, devices: Sequence[jax.Device], backend: Backend, segment: Segment
                  ) -> TrainStep:
    """The ZeRO step: reduce-scatter each flat gradient buffer, update this device's slice, all-gather.

    The gradients are raveled into one buffer per dtype, zero-padded to k equal slices
    (`jdp.parallel.buckets.Flat`); device i receives the sum of slice i only, updates slice i of the
    params with its slice of the optimizer state, and the new slices are all-gathered. Elementwise
    optimizers only (SGD, momentum, AdamW); the padding's gradient, state and params stay zero.
    """
    k = len(devices)

    def update_slice(variables, optimizer_state, grad_slices, local_batch):
        """Slice i of the params, updated with this device's state and summed gradient slice."""
        params = params_of(variables)
        return apply(plan(params, k).slices(params, lax.axis_index(AXIS)), optimizer_state, grad_slices, local_batch)

    def assemble(variables, gathered, state):
        params = params_of(variables)
        return with_params(variables, plan(params, k).unflatten(gathered), state)

    if strategy.where == "inside":

        def local_step(variables, optimizer_state, images, labels):
            loss, grads, state = local_grads(variables, images, labels)
            reduced = [strategy.reduce_scatter(b, AXIS) for b in plan(grads, k).flatten(grads)]  # my slice's sum
            mine, optimizer_state = update_slice(variables, optimizer_state, reduced, images.shape[0])
            gathered = [strategy.all_gather(m, AXIS) for m in mine]  # every slice, everywhere
            return assemble(variables, gathered, state), optimizer_state, loss

        return map_over_devices(local_step, devices, backend, ("replicated", opt.kind, "batch", "batch"),
                                ("replicated", opt.kind, "per_device"), donate=(0, 1))

    def local_buffers(variables, images, labels):
        loss, grads, state = local_grads(variables, images, labels)
        return loss, plan(grads, k).flatten(grads), state

    p_buffers = segment("compute", map_over_devices(local_buffers, devices, backend, ("replicated", "batch", "batch"),
                                                    ("per_device", "per_device", "replicated")))
    p_update = segment("compute", map_over_devices(
        lambda v, o, g, x: update_slice(v, o, g, x.shape[0]), devices, backend,
        ("replicated", opt.kind, "per_device", "batch"), ("per_device", opt.kind), donate=(1,)))
    p_assemble = segment("compute", map_over_devices(lambda v, g, s: (assemble(v, g, s),), devices, backend,
                                                     ("replicated", "per_device", "replicated"), ("replicated",),
                                                     donate=(0,)))
    reduce_scatter = segment("communication", lambda buffers: [strategy.reduce_scatter(b) for b in buffers])
    all_gather = segment("communication", lambda slices: [strategy.all_gather(m) for m in slices])

    def step(variables, optimizer_state, images, labels):
        loss, buffers, state = p_buffers(variables, images, labels)
        mine, optimizer_state = p_update(variables, optimizer_state, reduce_scatter(buffers), images)
        (variables,) = p_assemble(variables, all_gather(mine), state)
        return variables, optimizer_state, loss

    return step


# Whether XLA keeps one micro-batch's activations when unrolled micro-batches are ordered by
# `lax.optimization_barrier` (docs/optimizers.md has the measurement).
BARRIER_ORDERS_MICRO_BATCHES = jax.__version_info__ >= (0, 12)


def accumulate_grads(grads_fn: Callable, variables: PyTree, images: jax.Array, labels: jax.Array,
                     micro_batches: int, *, stateful: bool = False) -> tuple[jax.Array, PyTree, PyTree]:
    """Sums `grads_fn` over `micro_batches` equal parts of a device's shard, one part after another.

    The loss is a sum, so the summed gradients of the parts are the gradient of the whole shard: the
    allreduce and the update that follow are those of one step on the whole batch. Only one part's
    activations are alive at a time: the parts are unrolled, each read through `lax.optimization_barrier`
    with the running sum, so XLA cannot start part t before part t−1's gradients exist (a `lax.scan` would
    bound memory too, but XLA's CPU convolutions run far slower inside a loop). Where XLA does not keep
    that order (`BARRIER_ORDERS_MICRO_BATCHES` false: JAX before 0.12), the parts run in a `lax.scan`.
    A stateful model's state (BatchNorm statistics) is threaded from each part to the next, as N steps would.

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
            f"`accumulate={micro_batches}` cuts each device's {n} rows into {micro_batches} equal micro-batches, "
            f"which {n} does not allow: use a `batch_size` that is a multiple of devices × {micro_batches}."
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
