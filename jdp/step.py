"""The data-parallel train step and evaluation, built once from (model, optimizer, strategy).

Train step, per device: forward/backward on its shard of the batch (loss summed over the shard),
allreduce the gradients (sum over devices), divide by the FULL batch size, one optax update.
Every device applies the same update to the same params, so the replicas stay identical.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.allreduce import Allreduce
from jdp.inflight import InFlight
from jdp.placement import AXIS, shard_leading, unreplicate

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]
LossFn = Callable[[PyTree, jax.Array, jax.Array], jax.Array]
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
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    allreduce: Allreduce,
    devices: Sequence[jax.Device],
) -> TrainStep:
    """Builds the pmapped train step.

    Args:
      loss_fn: (params, images, labels) -> loss summed over the images.
      optimizer: applied to the mean gradient of the full batch.
      allreduce: how the per-device gradient sums are added up.
      devices: the devices the step runs on; inputs carry a leading axis of len(devices).

    Returns:
      step(params, opt_state, images, labels) -> (params, opt_state, losses): params and
      opt_state replicated, images/labels split with `split_batch`, losses the per-device sums.
      params and opt_state are donated: do not reuse the arrays passed in.
    """
    k = len(devices)
    grad_fn = jax.value_and_grad(loss_fn)

    def update(params, opt_state, grad_sum, local_batch):
        grads = jax.tree.map(lambda g: g / (local_batch * k), grad_sum)  # divide by the FULL batch
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if allreduce.where == "inside":

        def local_step(params, opt_state, images, labels):
            loss, grads = grad_fn(params, images, labels)
            grads = allreduce.fn(grads, AXIS)
            params, opt_state = update(params, opt_state, grads, images.shape[0])
            return params, opt_state, loss

        return jax.pmap(local_step, axis_name=AXIS, devices=devices, donate_argnums=(0, 1))

    p_grads = jax.pmap(grad_fn, axis_name=AXIS, devices=devices)
    p_update = jax.pmap(
        lambda p, s, g, x: update(p, s, g, x.shape[0]),
        axis_name=AXIS, devices=devices, donate_argnums=(0, 1),
    )

    def step(params, opt_state, images, labels):
        loss, grads = p_grads(params, images, labels)  # per-device gradients leave the device step
        grads = allreduce.fn(grads)  # explicit transfers between devices
        params, opt_state = p_update(params, opt_state, grads, images)
        return params, opt_state, loss

    return step


Evaluator = Callable[[PyTree, np.ndarray, np.ndarray], float]


def make_evaluator(
    apply_fn: ApplyFn,
    devices: Sequence[jax.Device],
    batch_size: int = 1000,
    *,
    on_all_devices: bool = True,
) -> Evaluator:
    """Builds `evaluate(params, images, labels) -> accuracy`, compiled once and reused every epoch.

    With `on_all_devices`, each batch is split over the devices and the correct counts are summed
    with `lax.psum`; the last partial batch is padded and masked, so the count is exactly the one
    a single device computes. Otherwise the first device evaluates everything (the lesson's way).

    Args:
      apply_fn: (params, images) -> logits.
      devices: the devices holding the replicated params.
      batch_size: images per evaluation batch, rounded up to a multiple of len(devices).
      on_all_devices: split evaluation over all devices, or use only the first.

    Returns:
      evaluate(params, images, labels): params replicated as the train step holds them.
    """
    k = len(devices) if on_all_devices else 1
    batch_size = -(-batch_size // k) * k

    if on_all_devices:
        count_fn = jax.pmap(
            lambda p, x, y, m: jax.lax.psum(_correct(apply_fn, p, x, y, m), AXIS),  # sum of counts
            axis_name=AXIS, devices=devices,
        )
        place = lambda a: shard_leading(a, devices)  # noqa: E731
        local = lambda params: params  # noqa: E731
    else:
        count_fn = jax.jit(lambda p, x, y, m: _correct(apply_fn, p, x, y, m))
        place = lambda a: jax.device_put(a, devices[0])  # noqa: E731
        local = unreplicate

    def evaluate(params: PyTree, images: np.ndarray, labels: np.ndarray) -> float:
        params, window, counts = local(params), InFlight(), []
        for start in range(0, len(images), batch_size):
            stop = start + batch_size
            x, y, mask = _padded(images[start:stop], labels[start:stop], batch_size)
            counts.append(count_fn(params, place(x), place(y), place(mask)))
            window.push(counts[-1])
        window.drain()
        return sum(int(np.asarray(c).reshape(-1)[0]) for c in counts) / len(images)

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


def _all_devices_counter(apply_fn: ApplyFn, devices: Sequence[jax.Device]):
    def count(params, x, y, mask):
        return jax.lax.psum(_correct(apply_fn, params, x, y, mask), AXIS)  # sum of correct counts

    return jax.pmap(count, axis_name=AXIS, devices=devices)


def _one_device_counter(apply_fn: ApplyFn):
    return jax.jit(lambda params, x, y, mask: _correct(apply_fn, params, x, y, mask))
