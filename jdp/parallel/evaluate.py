"""Test accuracy of replicated params, compiled once and reused every epoch.

The evaluation set is split over the devices like a training batch and the correct counts are
summed with `lax.psum`, or (the lesson's way) the first device evaluates everything.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdp import models
from jdp.data import Split
from jdp.parallel.inflight import InFlight
from jdp.parallel.layout import Backend, check_backend, map_over_devices, process_rows, shard_rows, unreplicate
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

ApplyFn = Callable[[PyTree, jax.Array], jax.Array]
EVAL_ON = ("all", "device0")  # split over all devices, or the lesson's way: the first device only


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
    place = lambda a: shard_rows(a[process_rows(len(a), devices)], devices, backend)  # noqa: E731

    if not on_all_devices:
        first = next(d for d in devices if d.process_index == jax.process_index())
        count_fn = jax.jit(lambda p, x, y, m: _correct(apply_fn, p, x, y, m))
        place = lambda a: jax.device_put(a, first)  # noqa: E731
        local = lambda params: jax.device_put(unreplicate(params, backend), first)  # noqa: E731
    else:
        count = map_over_devices(
            lambda p, x, y, m: (jax.lax.psum(_correct(apply_fn, p, x, y, m), AXIS),),  # sum of counts
            devices, backend, ("replicated", "batch", "batch", "batch"), ("replicated",))
        count_fn = lambda *args: count(*args)[0]  # noqa: E731

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


def make_epoch_evaluator(model: models.Model, devices: Sequence[jax.Device], backend: Backend, *,
                         on_all_devices: bool) -> Callable[[tuple[PyTree, PyTree], Callable, Split], tuple[tuple, float]]:
    """`evaluate(state, model_of, test) -> (state, test accuracy)` after each epoch: per-replica statistics
    averaged first (one set before evaluating and saving, see `jdp.models`), then the one model evaluated."""
    accuracy = make_evaluator(model.apply, devices, on_all_devices=on_all_devices, backend=backend)
    if model.per_replica_state:
        average = map_over_devices(lambda variables: (models.average_state(variables),), devices,
                                   backend, ("per_device",), ("per_device",), donate=(0,))

    def evaluate(state, model_of, test):
        if model.per_replica_state:
            state = (average(state[0])[0], state[1])
        return state, accuracy(model_of(state), test.images, test.labels)

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
