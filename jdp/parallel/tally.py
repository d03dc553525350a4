"""What the training loop learns from the devices: one small value, folded into on the devices by every call.

A GPU runs the lesson's step in about half a millisecond, and every read from a device makes the host
wait for it: ten small reads per step made the loop several times slower than its own compute. So no
call of the steady-state loop reads anything back. Each compiled call folds its losses and whether its
loss and params are finite into a `Tally` that stays on the devices; the host reads a tally rarely
(`jdp.training.guards.Watch` decides when) and always before a checkpoint and at the end of an epoch.

A tally is a `per_device` value (`jdp.parallel.layout`): each device folds in its own losses and its
own copy of the params, so folding needs no collective between devices or processes.

Checking every leaf of the params costs a small kernel per leaf, every call: on a GPU that is more launches
than the step of a small model. So a call that runs inside one compiled program checks its losses only;
params an update made non-finite make the next step's loss non-finite, and only then does the call look at
the params it was given (`lax.cond`: no cost otherwise) to name the call and the leaves that went wrong.
`jdp.training.guards.Watch` checks the params themselves before every checkpoint and at each epoch's end.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
      call_from: the first step of the last call folded in (step + 1 before the first; each epoch starts
        afresh, and the guards check the params at each epoch's end).
    """

    step: jax.Array | np.ndarray
    loss: jax.Array | np.ndarray
    bad_from: jax.Array | np.ndarray
    bad_to: jax.Array | np.ndarray
    finite: jax.Array | np.ndarray
    call_from: jax.Array | np.ndarray


def start(step: int, loss: Sequence[float], leaves: int) -> Tally:
    """A tally's host form at `step`, each device's loss of the epoch so far in `loss` (one per device)."""
    k = len(loss)
    return Tally(step=np.full(k, step, np.int32), loss=np.asarray(loss, np.float32), bad_from=np.zeros(k, np.int32),
                 bad_to=np.zeros(k, np.int32), finite=np.ones((k, 1 + leaves), bool),
                 call_from=np.full(k, step + 1, np.int32))  # after `step`: no call folded in yet


def fold(tally: Tally, entered: PyTree | None, left: PyTree, losses: jax.Array) -> Tally:
    """One device's tally after a call that ran `losses.size` steps, was given the params `entered` and left
    `left` (traced, per device).

    With `entered`, only the losses are checked, unless one is not finite (see the module docstring). Without
    (a step that donated its params before the fold could see them), every leaf of `left` is checked.
    """
    losses = losses.reshape(-1).astype(jnp.float32)
    total, step = losses.sum(), tally.step + losses.size
    this_call = tally.step + 1, step
    if entered is None:
        finite = leaf_flags(total, left)
        first = (tally.bad_to == 0) & ~finite.all()
        bad = this_call[0], this_call[1], finite
    else:
        first = (tally.bad_to == 0) & ~jnp.isfinite(total)

        def diagnose():
            given = leaf_flags(jnp.zeros((), jnp.float32), entered)
            earlier = ~given.all() & (tally.call_from <= tally.step)  # the previous call's update broke them
            return (jnp.where(earlier, tally.call_from, this_call[0]), jnp.where(earlier, tally.step, this_call[1]),
                    jnp.where(earlier, given, leaf_flags(total, left)))

        bad = lax.cond(first, diagnose, lambda: (tally.bad_from, tally.bad_to, tally.finite))
    return Tally(step=step, loss=tally.loss + total, bad_from=jnp.where(first, bad[0], tally.bad_from),
                 bad_to=jnp.where(first, bad[1], tally.bad_to), finite=jnp.where(first, bad[2], tally.finite),
                 call_from=this_call[0])


def leaf_flags(loss: jax.Array, params: PyTree) -> jax.Array:
    """(1 + leaves,) bools: whether `loss`, then each leaf of `params`, is finite."""
    return jnp.isfinite(jnp.stack([loss * 0, *(_nan_if_not_finite(x) for x in jax.tree.leaves(params))]))


def _nan_if_not_finite(x: jax.Array) -> jax.Array:
    """0 if every element of `x` is finite, else NaN: x·0 is 0 or NaN, and one fused sum reads `x` once."""
    return jnp.sum(x * jnp.zeros((), x.dtype), dtype=jnp.float32)


Fold = Callable[[Tally, PyTree | None, PyTree, jax.Array], Tally]  # (tally, entered, left, losses (k,) or (k, S))


def make_fold(devices: Sequence[jax.Device], backend: Backend, params_kind: Kinds = "replicated") -> Fold:
    """`fold` mapped over `devices`: traceable, so a compiled call of the train step can fold in its own losses."""
    mapped = map_over_devices(lambda tally, entered, left, losses: (fold(tally, entered, left, losses),), devices,
                              backend, ("per_device", params_kind, params_kind, "per_device"), ("per_device",))
    return lambda tally, entered, left, losses: mapped(tally, entered, left, losses)[0]


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
