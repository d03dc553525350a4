"""The data-parallel train step and evaluation, built once from (model, optimizer, strategy).

Train step, per device: forward/backward on its shard of the batch (loss summed over the shard),
allreduce the gradients (sum over devices), divide by the FULL batch size, one optax update.
Every device applies the same update to the same params, so the replicas stay identical.
Two backends map that program over the devices, of one process or several (see `jdp.distributed`):
`jax.pmap`, and `jax.jit(jax.shard_map(...))` over a 1-D mesh.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jdp.allreduce import STRATEGIES, Allreduce
from jdp.distributed import Backend, check_backend, local_copy, mesh, process_rows, put_rows
from jdp.errors import ConfigError
from jdp.inflight import InFlight
from jdp.placement import AXIS

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]
LossFn = Callable[[PyTree, jax.Array, jax.Array], jax.Array]
# (params, state, images, labels) -> (summed loss, new state): a model with state such as BatchNorm's statistics
StatefulLossFn = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[jax.Array, PyTree]]
# (params, opt_state, images, labels) -> (params, opt_state, per-device summed loss)
TrainStep = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[PyTree, PyTree, jax.Array]]


def summed_cross_entropy(apply_fn: ApplyFn) -> LossFn:
    """Softmax cross-entropy summed (not averaged) over the batch, as the lesson's `l.sum()`."""

    def loss_fn(params: PyTree, images: jax.Array, labels: jax.Array) -> jax.Array:
        logits = apply_fn(params, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

    return loss_fn


def sgd(learning_rate: float | optax.Schedule) -> optax.GradientTransformation:
    """The lesson's SGD: `param -= lr * grad`, where grad is already the full-batch mean."""
    return optax.sgd(learning_rate)


def make_train_step(
    loss_fn: LossFn | StatefulLossFn,
    optimizer: optax.GradientTransformation,
    allreduce: Allreduce,
    devices: Sequence[jax.Device],
    backend: Backend = "pmap",
    *,
    stateful: bool = False,
) -> TrainStep:
    """Builds the data-parallel train step, mapped once over `devices` by `backend`.

    Both backends run the same per-device program (the strategy is the one and only sum of the
    gradients); they differ in how arrays are laid out (see `jdp.distributed`):

    * ``pmap``: `jax.pmap`; params/opt_state (k, ...) with a leading device axis, batch (k, B/k, ...).
    * ``shard_map``: `jax.jit(jax.shard_map(...))` over a 1-D mesh; params/opt_state replicated with
      `P()`, batch (B, ...) sharded with `P('data')`.

    With either, `devices` may span several processes (`jdp.distributed`); `jax.pmap` then returns
    each process's part of its outputs, `jit` global arrays.

    Args:
      loss_fn: (params, images, labels) -> loss summed over the images; with `stateful`,
        (params, state, images, labels) -> (summed loss, new state), e.g. BatchNorm statistics.
      optimizer: applied to the mean gradient of the full batch.
      allreduce: how the per-device gradient sums are added up.
      devices: the devices the step runs on (the mesh, in order).
      backend: "pmap" or "shard_map".
      stateful: the step's first argument is {"params", "state"} (see `jdp.models`): only "params"
        is differentiated and updated, "state" is replaced by the loss's new state.

    Returns:
      step(params, opt_state, images, labels) -> (params, opt_state, losses): inputs placed with
      `jdp.distributed.put_replicated` / `put_batch` for `backend`, losses the per-device sums, shape (k,).
      params and opt_state are donated: do not reuse the arrays passed in.

    Raises:
      ConfigError: for an unknown backend, or an "outside" strategy over devices of several processes.
    """
    check_backend(backend)
    if allreduce.where == "outside" and any(d.process_index != jax.process_index() for d in devices):
        inside = ", ".join(name for name, s in STRATEGIES.items() if s.where == "inside")
        raise ConfigError(
            f"`--allreduce {allreduce.name}` copies buffers between devices with `jax.device_put`, which only "
            f"reaches this process's devices, but the step spans {jax.process_count()} processes. "
            f"Use a collective strategy instead: {inside}."
        )
    k = len(devices)

    def local_grads(variables, images, labels):
        """(loss, gradient sum over this device's shard, new model state or None)."""
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
        grads = allreduce.fn(grads, AXIS)  # the one reduction over the devices
        variables, opt_state = update(variables, opt_state, grads, state, images.shape[0])
        return variables, opt_state, loss

    if backend == "shard_map":
        return _shard_map_step(local_step, local_grads, update, allreduce, devices)
    if allreduce.where == "inside":
        return jax.pmap(local_step, axis_name=AXIS, devices=devices, donate_argnums=(0, 1))
    p_grads = jax.pmap(local_grads, axis_name=AXIS, devices=devices)
    p_update = jax.pmap(
        lambda v, o, g, s, x: update(v, o, g, s, x.shape[0]),
        axis_name=AXIS, devices=devices, donate_argnums=(0, 1),
    )
    return _outside_step(p_grads, allreduce, p_update)


def _outside_step(grads_fn, allreduce: Allreduce, update_fn) -> TrainStep:
    """The step of an "outside" strategy: three calls, with the allreduce's transfers between them."""

    def step(variables, opt_state, images, labels):
        loss, grads, state = grads_fn(variables, images, labels)  # per-device gradients leave the device step
        grads = allreduce.fn(grads)  # explicit transfers between devices
        variables, opt_state = update_fn(variables, opt_state, grads, state, images)
        return variables, opt_state, loss

    return step


def _shard_map_step(local_step, local_grads, update, allreduce: Allreduce,
                    devices: Sequence[jax.Device]) -> TrainStep:
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
    return _outside_step(s_grads, allreduce, s_update)


Evaluator = Callable[[PyTree, np.ndarray, np.ndarray], float]


def make_evaluator(
    apply_fn: ApplyFn,
    devices: Sequence[jax.Device],
    batch_size: int = 1000,
    *,
    on_all_devices: bool = True,
    backend: Backend = "pmap",
) -> Evaluator:
    """Builds `evaluate(params, images, labels) -> accuracy`, compiled once and reused every epoch.

    With `on_all_devices`, each batch is split over the devices and the correct counts are summed
    with `lax.psum`; the last partial batch is padded and masked, so the count is exactly the one
    a single device computes. Otherwise the first device evaluates everything (the lesson's way;
    with several processes, each evaluates on its own first device).

    Args:
      apply_fn: (params, images) -> logits.
      devices: the devices holding the replicated params.
      batch_size: images per evaluation batch, rounded up to a multiple of len(devices).
      on_all_devices: split evaluation over all devices, or use only the first.
      backend: the layout of the params, as the train step of that backend holds them.

    Returns:
      evaluate(params, images, labels): params replicated as the train step holds them; every
      process passes the whole evaluation set.
    """
    check_backend(backend)
    k = len(devices) if on_all_devices else 1
    batch_size = -(-batch_size // k) * k
    local = lambda params: params  # noqa: E731
    place = lambda a: put_rows(a[process_rows(len(a), devices)], len(a), devices, backend)  # noqa: E731

    if not on_all_devices:
        first = next(d for d in devices if d.process_index == jax.process_index())
        count_fn = jax.jit(lambda p, x, y, m: _correct(apply_fn, p, x, y, m))
        place = lambda a: jax.device_put(a, first)  # noqa: E731
        local = lambda params: jax.device_put(local_copy(params, backend), first)  # noqa: E731
    elif backend == "pmap":
        count_fn = jax.pmap(
            lambda p, x, y, m: jax.lax.psum(_correct(apply_fn, p, x, y, m), AXIS),  # sum of counts
            axis_name=AXIS, devices=devices,
        )
    else:
        count_fn = jax.jit(jax.shard_map(
            lambda p, x, y, m: jax.lax.psum(_correct(apply_fn, p, x, y, m), AXIS),  # sum of counts
            mesh=mesh(devices), in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), out_specs=P(),
        ))

    def evaluate(params: PyTree, images: np.ndarray, labels: np.ndarray) -> float:
        params, window, counts = local(params), InFlight(), []
        for start in range(0, len(images), batch_size):
            stop = start + batch_size
            x, y, mask = _padded(images[start:stop], labels[start:stop], batch_size)
            counts.append(count_fn(params, place(x), place(y), place(mask)))
            window.push(counts[-1])
        window.drain()
        return sum(int(np.asarray(c.addressable_data(0)).reshape(-1)[0]) for c in counts) / len(images)

    return evaluate


def _padded(x: np.ndarray, y: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    short = size - len(x)
    mask = np.arange(size) < len(x)
    if short:
        x = np.concatenate([x, np.zeros((short, *x.shape[1:]), x.dtype)])
        y = np.concatenate([y, np.zeros((short,), y.dtype)])
    return x, y, mask


def _correct(apply_fn: ApplyFn, params, x, y, mask) -> jax.Array:
    hits = (jnp.argmax(apply_fn(params, x), axis=-1) == y) & mask
    return hits.sum(dtype=jnp.int32)
