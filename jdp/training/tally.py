"""What the training loop learns from the devices: one small value, folded into on the devices by every call.

A GPU runs the lesson's step in about half a millisecond, and every read from a device makes the host
wait for it: ten small reads per step made the loop several times slower than its own compute. So no
call of the steady-state loop reads anything back. Each compiled call folds its losses and whether its
loss and params are finite into a `Tally` that stays on the devices; the host reads a tally rarely
(`jdp.training.guards.Watch` decides when) and always before a checkpoint and at the end of an epoch.

A tally is a `per_device` value (`jdp.parallel.layout`): each device folds in its own losses and its
own copy of the params, so folding needs no collective between devices or processes.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdp.parallel.layout import Backend, Kinds, map_over_devices, place, to_host
from jdp.types import PyTree


class Tally(NamedTuple):
    """One row per device (a leading device axis on the devices and on the host).

    Attributes:
      step: steps run in the whole run, up to the last call folded in.
      loss: the device's summed loss of the epoch's steps (float32, summed in step order).
      bad_from: the first step of the first call whose loss or params were not finite; 0: none so far.
      bad_to: that call's last step (a call runs `steps_per_call` steps).
      finite: (1 + leaves,) at that call: whether the loss, then each leaf of the params, was finite.
    """

    step: jax.Array | np.ndarray
    loss: jax.Array | np.ndarray
    bad_from: jax.Array | np.ndarray
    bad_to: jax.Array | np.ndarray
    finite: jax.Array | np.ndarray


def start(step: int, loss: Sequence[float], leaves: int) -> Tally:
    """A tally's host form at `step`, each device's loss of the epoch so far in `loss` (one per device)."""
    k = len(loss)
    return Tally(step=np.full(k, step, np.int32), loss=np.asarray(loss, np.float32), bad_from=np.zeros(k, np.int32),
                 bad_to=np.zeros(k, np.int32), finite=np.ones((k, 1 + leaves), bool))


def fold(tally: Tally, params: PyTree, losses: jax.Array) -> Tally:
    """One device's tally after a call that ran `losses.size` steps and left `params` (traced, per device)."""
    losses = losses.reshape(-1).astype(jnp.float32)
    finite = jnp.isfinite(jnp.stack([_nan_if_not_finite(x) for x in (losses, *jax.tree.leaves(params))]))
    step = tally.step + losses.size
    first = (tally.bad_to == 0) & ~finite.all()
    return Tally(step=step, loss=tally.loss + losses.sum(), bad_from=jnp.where(first, tally.step + 1, tally.bad_from),
                 bad_to=jnp.where(first, step, tally.bad_to), finite=jnp.where(first, finite, tally.finite))


def _nan_if_not_finite(x: jax.Array) -> jax.Array:
    """0 if every element of `x` is finite, else NaN: x·0 is 0 or NaN, and one fused sum reads `x` once."""
    return jnp.sum(x * jnp.zeros((), x.dtype), dtype=jnp.float32)


Fold = Callable[[Tally, PyTree, jax.Array], Tally]  # (tally, params, losses (k,) or (k, S)) -> tally, on the devices


def make_fold(devices: Sequence[jax.Device], backend: Backend, params_kind: Kinds = "replicated") -> Fold:
    """`fold` mapped over `devices`: traceable, so a compiled call of the train step can fold in its own losses."""
    mapped = map_over_devices(lambda tally, params, losses: (fold(tally, params, losses),), devices, backend,
                              ("per_device", params_kind, "per_device"), ("per_device",))
    return lambda tally, params, losses: mapped(tally, params, losses)[0]


def place_tally(tally: Tally, devices: Sequence[jax.Device], backend: Backend) -> Tally:
    """The host form (`start`) on the devices, row i on device i."""
    return place(tally, "per_device", devices, backend)


def read_local(tally: Tally) -> Tally:
    """This process's rows of a tally on the devices, in device order: no collective, one small copy per device."""

    def rows(x: jax.Array) -> np.ndarray:
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data).reshape(-1, *x.shape[1:]) for s in shards])

    return Tally(*(rows(x) for x in tally))


def losses_of_all(tally: Tally) -> np.ndarray:
    """Every device's summed loss (k,), from every process: a collective with several processes."""
    return to_host(tally.loss).reshape(-1)
